//! The SM90 attention (`kernels/attention_sm90.cu`, README "Attention forward", "Fixed splits"
//! and "Attention backward"). Forward: one CTA per 128 (Dh 64: 192) packed query rows of one
//! (batch row, KV head) group, keys in fixed blocks from key 0, the softmax restarted and merged
//! every `ATTN_SPLIT` keys. Backward: a pre-pass per query row, then `dQ` per query tile (keys
//! ascending) and `dK`/`dV` per 128-key block (query heads, then query blocks ascending).
use burn::tensor::{DType, FloatDType, Shape, ops::FloatTensorOps};
use burn_cubecl::kernel::into_contiguous;

use super::nvrtc::launch;
use super::operand::TmaOperand;
use super::params::AttnParams;
use super::sm_count;
use super::table::{Entry, constant, lookup};
use crate::backends::alloc::{empty, zeros};
use crate::backends::cuda::{CudaOps, CudaTensor};

const ATTN_CAUSAL: u32 = constant("ATTN_CAUSAL") as u32;

/// Head sizes the kernels are built for.
pub(crate) const HEAD_DIMS: [usize; 2] = [64, 128];

/// Query rows of one CTA of the split forwards and of `dQ`.
const Q_TILE: usize = constant("ATTN_Q_TILE");

/// Keys per split of the split forwards (kernels/README.md, "Fixed splits").
const SPLIT: usize = constant("ATTN_SPLIT");

/// Keys per CTA of the `dK`/`dV` kernel.
const KEY_TILE: usize = constant("ATTN_BWD_TILE");

/// The launches of one (dtype, head size).
#[derive(Clone, Copy)]
struct Kernels {
    /// The plain forward (Dh 64: the three-warpgroup one, 192-row tiles, the same bits).
    forward: Entry,
    /// The forward merging fixed splits in each CTA.
    split: Entry,
    /// One CTA per split, then `merge`.
    part: Entry,
    merge: Entry,
    prep: Entry,
    dq: Entry,
    dkdv: Entry,
}

/// The `Kernels` of the entry names ending in `_<suffix>` (const: a name missing from
/// `kernels/entries.txt` fails to compile, as `entry!`).
macro_rules! kernels {
    ($forward:literal, $suffix:literal) => {{
        const KERNELS: Kernels = Kernels {
            forward: lookup(concat!("ib_attn_fwd_", $forward, $suffix)),
            split: lookup(concat!("ib_attn_fwd_split_", $suffix)),
            part: lookup(concat!("ib_attn_fwd_part_", $suffix)),
            merge: lookup(concat!("ib_attn_merge_", $suffix)),
            prep: lookup(concat!("ib_attn_bwd_prep_", $suffix)),
            dq: lookup(concat!("ib_attn_bwd_dq_", $suffix)),
            dkdv: lookup(concat!("ib_attn_bwd_dkdv_", $suffix)),
        };
        KERNELS
    }};
}

fn kernels(dtype: DType, head_dim: usize) -> Kernels {
    match (dtype, head_dim) {
        (DType::BF16, 64) => kernels!("wide_", "bf16_d64"),
        (DType::BF16, 128) => kernels!("", "bf16_d128"),
        (DType::F16, 64) => kernels!("wide_", "f16_d64"),
        (DType::F16, 128) => kernels!("", "f16_d128"),
        other => unreachable!(
            "the registry admits Sm90 attention for bf16/f16 at Dh 64/128, got {other:?}"
        ),
    }
}

/// `t [d0, d1, d2, dh]` as a contiguous `[d0·d1·d2, dh]` view (a copy only when `t` is not
/// contiguous).
fn row_view(t: CudaTensor) -> CudaTensor {
    let shape = t.meta.shape().to_vec();
    let rows = shape[..3].iter().product::<usize>();
    CudaOps::float_reshape(into_contiguous(t), Shape::new([rows, shape[3]]))
}

/// The kernels' `AttnParams` of a call: query `[b, h, q, _]`, key `[_, kh, kv, _]`.
fn attn_params([b, h, q, kh, kv]: [usize; 5], causal: bool, scale: f32) -> AttnParams {
    AttnParams {
        b: b as u32,
        h: h as u32,
        kh: kh as u32,
        q: q as u32,
        kv: kv as u32,
        flags: if causal { ATTN_CAUSAL } else { 0 },
        scale,
        pad: 0,
    }
}

/// Forward: `(out [B, H, Q, Dh], lse [B, H, Q] f32)`. `kv_lens` is `[B]` i32.
pub(crate) fn attention(
    query: CudaTensor,
    key: CudaTensor,
    value: CudaTensor,
    kv_lens: CudaTensor,
    causal: bool,
    scale: f32,
) -> (CudaTensor, CudaTensor) {
    let [b, h, q, dh]: [usize; 4] = query.meta.shape().to_vec().try_into().expect("rank 4");
    let [_, kh, kv, _]: [usize; 4] = key.meta.shape().to_vec().try_into().expect("rank 4");
    let dtype = query.dtype;
    if b * h * q == 0 || kv == 0 {
        // No query, or no key: every query sits at a negative position (zeros, lse = −∞).
        let out = zeros(&query, vec![b, h, q, dh], dtype);
        let lse = if b * h * q == 0 {
            empty(&query, vec![b, h, q], DType::F32)
        } else {
            CudaOps::float_full(
                Shape::new([b, h, q]),
                f32::NEG_INFINITY.into(),
                &query.device,
                FloatDType::F32,
            )
        };
        return (out, lse);
    }
    let out = empty(&query, vec![b, h, q, dh], dtype);
    let lse = empty(&query, vec![b, h, q], DType::F32);
    let kv_lens = into_contiguous(kv_lens);
    // The forward takes a scale >= 0 (one softmax path, README "Numerics"): -Q with |scale| gives the
    // same products, exactly.
    let (query, scale) = if scale < 0.0 {
        (CudaOps::float_neg(query), -scale)
    } else {
        (query, scale)
    };
    let [query, key, value] = [query, key, value].map(|t| TmaOperand::new(row_view(t)));
    let params = attn_params([b, h, q, kh, kv], causal, scale);
    let k = kernels(dtype, dh);
    let tiles = |rows: usize| b * kh * (h / kh * q).div_ceil(rows);
    let grid = tiles(Q_TILE);
    let maps = vec![
        query.map(0, b * h * q),
        key.map(0, b * kh * kv),
        value.map(0, b * kh * kv),
    ];
    // The operands are buffers too: cubecl orders only buffer arguments across streams.
    let buffers = vec![
        query.binding(),
        key.binding(),
        value.binding(),
        kv_lens.handle.clone().binding(),
        out.handle.clone().binding(),
        lse.handle.clone().binding(),
    ];
    // Rows see at most KV keys: within one split every forward gives the plain one's bits. Past it
    // the split forwards give the same bits as each other, so the choice is by speed alone: one CTA
    // per (tile, split) and a merge where the tiles alone would leave most SMs idle (decode).
    let client = out.client.clone();
    if kv <= SPLIT {
        let grid = tiles(k.forward.tile[0]);
        launch(&client, k.forward, grid, maps, buffers, &params);
    } else if grid >= sm_count(&client) {
        launch(&client, k.split, grid, maps, buffers, &params);
    } else {
        let (splits, rows) = (kv.div_ceil(SPLIT), b * h * q);
        let ws_o = empty(&out, vec![splits * rows * dh], DType::F32);
        let ws_ml = empty(&out, vec![splits * rows * 5], DType::F32);
        let mut part = buffers[..4].to_vec();
        part.extend([&ws_o, &ws_ml].map(|t| t.handle.clone().binding()));
        launch(&client, k.part, grid * splits, maps, part, &params);
        let merge = [&kv_lens, &ws_o, &ws_ml, &out, &lse].map(|t| t.handle.clone().binding());
        let merge_grid = rows.div_ceil(k.merge.tile[0]);
        launch(
            &client,
            k.merge,
            merge_grid,
            vec![],
            merge.to_vec(),
            &params,
        );
    }
    (out, lse)
}

/// Backward from the forward's `out` and `lse` and the upstream `grad`: `(dq, dk, dv)`.
pub(crate) fn attention_backward(
    [query, key, value]: [CudaTensor; 3],
    kv_lens: CudaTensor,
    [out, lse, grad]: [CudaTensor; 3],
    causal: bool,
    scale: f32,
) -> [CudaTensor; 3] {
    let [b, h, q, dh]: [usize; 4] = query.meta.shape().to_vec().try_into().expect("rank 4");
    let [_, kh, kv, _]: [usize; 4] = key.meta.shape().to_vec().try_into().expect("rank 4");
    let dtype = query.dtype;
    if b * h * q == 0 || kv == 0 {
        // No query or no key: nothing is seen, every gradient is zero.
        return [
            zeros(&query, vec![b, h, q, dh], dtype),
            zeros(&query, vec![b, kh, kv, dh], dtype),
            zeros(&query, vec![b, kh, kv, dh], dtype),
        ];
    }
    let k = kernels(dtype, dh);
    let params = attn_params([b, h, q, kh, kv], causal, scale);
    let client = query.client.clone();
    let [query, out, grad] = [query, out, grad].map(row_view);
    let rows = b * h * q;
    let (lse, kv_lens) = (into_contiguous(lse), into_contiguous(kv_lens));
    // Pre-pass: per query row {lse·log2 e, δ = dO·O, visible keys}, and Q with padding rows zeroed.
    let qz = empty(&query, vec![rows, dh], dtype);
    let row_info = empty(&query, vec![rows, 4], DType::F32);
    let buffers = [&kv_lens, &query, &out, &grad, &lse, &qz, &row_info];
    let buffers = buffers.map(|t| t.handle.clone().binding()).to_vec();
    launch(
        &client,
        k.prep,
        rows.div_ceil(k.prep.tile[0]),
        vec![],
        buffers,
        &params,
    );
    let dq = empty(&query, vec![b, h, q, dh], dtype);
    let dk = empty(&query, vec![b, kh, kv, dh], dtype);
    let dv = empty(&query, vec![b, kh, kv, dh], dtype);
    let (qz, query, grad) = (
        TmaOperand::new(qz),
        TmaOperand::new(query),
        TmaOperand::new(grad),
    );
    let [key, value] = [key, value].map(|t| TmaOperand::new(row_view(t)));
    let key_rows = b * kh * kv;
    let maps = |a: &TmaOperand| {
        vec![
            a.map(0, rows),
            grad.map(0, rows),
            key.map(0, key_rows),
            value.map(0, key_rows),
        ]
    };
    let operands =
        |a: &TmaOperand| vec![a.binding(), grad.binding(), key.binding(), value.binding()];
    let info = [&kv_lens, &row_info].map(|t| t.handle.clone().binding());
    // dQ: the forward's tiles.
    let mut buffers = operands(&query);
    buffers.extend(info.clone());
    buffers.push(dq.handle.clone().binding());
    let grid = b * kh * (h / kh * q).div_ceil(Q_TILE);
    launch(&client, k.dq, grid, maps(&query), buffers, &params);
    // dK, dV: 128-key blocks.
    let mut buffers = operands(&qz);
    buffers.extend(info);
    buffers.extend([&dk, &dv].map(|t| t.handle.clone().binding()));
    let grid = b * kh * kv.div_ceil(KEY_TILE);
    launch(&client, k.dkdv, grid, maps(&qz), buffers, &params);
    [dq, dk, dv]
}
