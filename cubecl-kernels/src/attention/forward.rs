//! The forward: one cube per (batch row, KV head, tile of `16·rows` query rows of the KV head's
//! group), all query heads of the group in the tile, so each block of 64 keys and values is
//! staged once for all of them.

use super::AttentionRefs;
use super::inputs::{Checked, Layouts, check_inputs};
use super::math::{div_rn, exp_p, ln_p, neg_inf};
use super::tc_forward::{
    TC_WARPS, TcCfg, attention_tc_forward_kernel, tc_forward_supported, tc_split,
};
use super::tile::{
    AttnCfg, AttnParams, DC, KEY_BLOCK, RowSrc, S_PAD, SCALE_A, STAGE_LEN, UNITS, dot_tile,
    kv_len_of, load_chunk, visible,
};
use crate::error::KernelError;
use crate::gemm::fma::fma_f32;
use crate::util::{FloatDType, check_out_view, expect_shape, launch_chunks, raw_arg};
use cubecl::prelude::*;

/// Forward: `out [B, H, Q, D]` (the inputs' dtype, every element written) and
/// `lse [B, H, Q]` (f32). The arithmetic is docs/CONTRACT.md's *attention semantics*, element
/// for element the Reference's: keys in blocks of [`super::ATTENTION_KEY_BLOCK`] from key 0,
/// the last cut at the query's last visible key; per block the score max, `α = exp_p(m − m')`,
/// `p_j = exp_p(s_j − m')`, `l_b` by ascending adds, `o_b` as an fma chain over the keys, then
/// `l = fma(l, α, l_b)`, `o = fma(o, α, o_b)`; `out = o / l` rounded once, `lse = m + ln_p(l)`.
/// Queries with a negative position get zeros and `lse = −∞`. f16 / bf16 where
/// [`attention_forward_uses_tensor_cores`] says so: the tensor-core forward (the contract's
/// tensor-core arithmetic, `tc_forward.rs`).
pub fn attention_forward<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &AttentionRefs<'_, R>,
    out: &TensorBinding<R>,
    lse: &TensorBinding<R>,
) -> Result<(), KernelError> {
    let c = check_inputs(client, inputs)?;
    let dims = c.dims;
    let ov = check_out_view("out", out, 4, c.dt.size())?;
    expect_shape(
        "out",
        &ov,
        &[dims.batch, dims.heads, dims.q_len, dims.head_dim],
    )?;
    let lv = check_out_view("lse", lse, 3, 4)?;
    expect_shape("lse", &lv, &[dims.batch, dims.heads, dims.q_len])?;
    let rows = dims.batch * dims.heads * dims.q_len;
    if rows == 0 {
        return Ok(());
    }
    let layouts = Layouts {
        o: Some(&ov),
        lse: Some(&lv),
        ..c.layouts()
    };
    if tc_forward_supported(client, c.dt, dims.head_dim) {
        launch_tc(client, inputs, &c, out, lse, &layouts);
        return Ok(());
    }
    let cfg = c.cfg(client, query_rows(&c));
    let tiles = (dims.group() * dims.q_len).div_ceil(UNITS * cfg.rows);
    let cubes = dims.batch * dims.kv_heads * tiles;
    for (start, len) in launch_chunks(client, 0, cubes, 1) {
        unsafe {
            attention_forward_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(len as u32, 1, 1),
                CubeDim::new_2d(UNITS as u32, UNITS as u32),
                raw_arg(inputs.query),
                raw_arg(inputs.key),
                raw_arg(inputs.value),
                raw_arg(inputs.kv_lens),
                raw_arg(out),
                raw_arg(lse),
                layouts.params(&c, start),
                cfg,
                c.dt.storage(),
            );
        }
    }
    Ok(())
}

/// The tensor-core forward ([`super::tc_forward`]): one cube of 4 warps per 64 rows of a KV
/// group, or per 16 rows (the warps splitting the columns) where the group has at most 16.
fn launch_tc<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &AttentionRefs<'_, R>,
    c: &Checked,
    out: &TensorBinding<R>,
    lse: &TensorBinding<R>,
    layouts: &Layouts<'_>,
) {
    let dims = c.dims;
    let group_rows = dims.group() * dims.q_len;
    // The split tiling computes every element as the 64-row one does: it may follow the shape.
    let cfg = TcCfg {
        d: dims.head_dim,
        causal: c.causal,
        emulate: c.cfg(client, 1).emulate,
        split: tc_split(group_rows, dims.head_dim),
    };
    let tiles = group_rows.div_ceil(cfg.rows());
    let cubes = dims.batch * dims.kv_heads * tiles;
    for (start, len) in launch_chunks(client, 0, cubes, 1) {
        unsafe {
            attention_tc_forward_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(len as u32, 1, 1),
                CubeDim::new_2d(32, TC_WARPS as u32),
                raw_arg(inputs.query),
                raw_arg(inputs.key),
                raw_arg(inputs.value),
                raw_arg(inputs.kv_lens),
                raw_arg(out),
                raw_arg(lse),
                layouts.params(c, start),
                cfg,
                c.dt.storage(),
            );
        }
    }
}

/// Which forward runs for `dtype` and `head_dim` on this client: the tensor-core one (f16 /
/// bf16, head sizes multiples of 16 up to 128, CUDA's `mma.sync`) or the FMA one. Depends on
/// nothing else (never on the batch or the lengths).
#[doc(hidden)]
pub fn attention_forward_uses_tensor_cores<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: FloatDType,
    head_dim: usize,
) -> bool {
    tc_forward_supported(client, dtype, head_dim)
}

/// Rows per unit of the query-row kernels (forward, dQ): the tile is `16·rows` query rows of a
/// KV group. Every element's arithmetic is the same whatever the tile, so the tile may follow
/// the shape: small groups of queries (decode) take 16-row tiles.
pub(crate) fn query_rows(c: &Checked) -> usize {
    let gq = c.dims.group() * c.dims.q_len;
    if gq > 2 * UNITS {
        4
    } else if gq > UNITS {
        2
    } else {
        1
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)] // the kernel's bindings; the scalars travel in `p`
pub(crate) fn attention_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    kv_lens: &Tensor<i32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    p: AttnParams,
    #[comptime] cfg: AttnCfg,
    #[define(F)] _dtype: StorageType,
) {
    let d = comptime![cfg.d];
    let ra = comptime![cfg.rows];
    let emulate = comptime![cfg.emulate];
    let br = comptime![UNITS * cfg.rows];
    let nch = comptime![cfg.chunks()];
    let ncol = comptime![cfg.cols()];
    let unroll = comptime![!cfg.emulate];

    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let tid = ty * UNITS + tx;
    let q_len = p.q_len as usize;
    let group = p.group as usize;
    let kvh = p.kv_heads as usize;
    let gq = group * q_len;
    let tiles = gq.div_ceil(br);
    let cube = p.offset as usize + CUBE_POS_X as usize;
    let tile = cube % tiles;
    let bkh = cube / tiles;
    let b = bkh / kvh;
    let kh = bkh % kvh;
    let r0 = tile * br;
    let len = kv_len_of(kv_lens, b * p.lens as usize, p.kv_len);

    let mut stage = SharedMemory::<f32>::new(STAGE_LEN);
    let mut ss = SharedMemory::<f32>::new(br * S_PAD);
    let mut vis_s = SharedMemory::<u32>::new(br);
    let mut cnt_s = SharedMemory::<u32>::new(br);
    let mut mx_s = SharedMemory::<f32>::new(br);
    let mut al_s = SharedMemory::<f32>::new(br);
    let mut l_s = SharedMemory::<f32>::new(br);

    if tid < br {
        let r = r0 + tid;
        let mut vis = 0u32;
        if r < gq {
            vis = visible(len, p.q_len, r % q_len, comptime![cfg.causal]);
        }
        vis_s[tid] = vis;
    }
    sync_cube();
    let mut max_vis = 0u32;
    for rr in 0..br {
        max_vis = max(max_vis, vis_s[rr]);
    }
    let max_vis = max_vis as usize;

    let qsrc = RowSrc {
        base: b * p.q.b as usize + kh * group * p.q.h as usize,
        first: r0,
        limit: gq,
        inner: q_len,
        s_outer: p.q.h as usize,
        s_inner: p.q.s as usize,
        s_d: p.q.d as usize,
    };
    let kbase = b * p.k.b as usize + kh * p.k.h as usize;
    let vbase = b * p.v.b as usize + kh * p.v.h as usize;

    // The row owner's (unit `tid < br`, row `r0 + tid`) running max and sum.
    let mut m = neg_inf();
    let mut l = 0.0f32;
    let mut o = Array::<f32>::new(ra * ncol);
    #[unroll]
    for x in 0..ra * ncol {
        o[x] = 0.0f32;
    }
    let mut s = Array::<f32>::new(ra * 4);

    let nblocks = max_vis.div_ceil(KEY_BLOCK);
    for kb in 0..nblocks {
        let j0 = kb * KEY_BLOCK;
        let bend = min(j0 + KEY_BLOCK, max_vis);
        let ksrc = RowSrc {
            base: kbase,
            first: j0,
            limit: bend,
            inner: bend,
            s_outer: 0usize,
            s_inner: p.k.s as usize,
            s_d: p.k.d as usize,
        };
        dot_tile::<F>(
            q, &qsrc, k, &ksrc, p.scale, &mut stage, &mut s, ra, 4usize, SCALE_A, d, emulate,
        );
        #[unroll]
        for i in 0..ra {
            #[unroll]
            for c in 0..4usize {
                ss[(ty + i * UNITS) * S_PAD + tx + c * UNITS] = s[i * 4 + c];
            }
        }
        sync_cube();
        // Row owners: the block's max over the row's visible keys, and α.
        if tid < br {
            let vis = vis_s[tid] as usize;
            let mut cnt = 0usize;
            if vis > j0 {
                cnt = min(KEY_BLOCK, vis - j0);
            }
            let mut mn = m;
            for j in 0..cnt {
                let x = ss[tid * S_PAD + j];
                mn = select(x > mn, x, mn);
            }
            mx_s[tid] = mn;
            al_s[tid] = exp_p(m - mn, emulate);
            cnt_s[tid] = cnt as u32;
        }
        sync_cube();
        // p = exp_p(s − m') for the unit's own scores.
        #[unroll]
        for i in 0..ra {
            let row = ty + i * UNITS;
            #[unroll]
            for c in 0..4usize {
                let key = tx + c * UNITS;
                if (key as u32) < cnt_s[row] {
                    ss[row * S_PAD + key] = exp_p(s[i * 4 + c] - mx_s[row], emulate);
                }
            }
        }
        sync_cube();
        // Row owners: l_b by ascending adds, l = fma(l, α, l_b), m = m'.
        if tid < br {
            let cnt = cnt_s[tid] as usize;
            if cnt > 0 {
                let mut lb = 0.0f32;
                for j in 0..cnt {
                    lb += ss[tid * S_PAD + j];
                }
                l = fma_f32(l, al_s[tid], lb, emulate);
                m = mx_s[tid];
            }
        }
        // o_b = fma-chain over the block's keys of p·v, then o = fma(o, α, o_b), chunk by chunk.
        let vsrc = RowSrc {
            base: vbase,
            first: j0,
            limit: bend,
            inner: bend,
            s_outer: 0usize,
            s_inner: p.v.s as usize,
            s_d: p.v.d as usize,
        };
        let nk = bend - j0;
        #[unroll(unroll)]
        for ch in 0..nch {
            load_chunk::<F>(
                v,
                &vsrc,
                ch * DC,
                p.scale,
                &mut stage,
                0usize,
                KEY_BLOCK,
                false,
                d,
            );
            sync_cube();
            let mut ob = Array::<f32>::new(ra * 2);
            #[unroll]
            for x in 0..ra * 2 {
                ob[x] = 0.0f32;
            }
            for j in 0..nk {
                let v0 = stage[j * DC + tx];
                let v1 = stage[j * DC + tx + UNITS];
                #[unroll]
                for i in 0..ra {
                    let row = ty + i * UNITS;
                    if (j as u32) < cnt_s[row] {
                        let pj = ss[row * S_PAD + j];
                        ob[i * 2] = fma_f32(pj, v0, ob[i * 2], emulate);
                        ob[i * 2 + 1] = fma_f32(pj, v1, ob[i * 2 + 1], emulate);
                    }
                }
            }
            #[unroll]
            for i in 0..ra {
                let row = ty + i * UNITS;
                if cnt_s[row] > 0u32 {
                    #[unroll]
                    for c in 0..2usize {
                        let x = i * ncol + ch * 2 + c;
                        o[x] = fma_f32(o[x], al_s[row], ob[i * 2 + c], emulate);
                    }
                }
            }
            sync_cube();
        }
        // The next block rewrites the scores (needed where no chunk loop ran: D = 0).
        sync_cube();
    }

    if tid < br {
        l_s[tid] = l;
        let r = r0 + tid;
        if r < gq {
            let h = kh * group + r / q_len;
            let i = r % q_len;
            let at = b * p.lse.b as usize + h * p.lse.h as usize + i * p.lse.s as usize;
            let mut val = neg_inf();
            if vis_s[tid] > 0u32 {
                val = m + ln_p(l, emulate);
            }
            lse[at] = val;
        }
    }
    sync_cube();
    #[unroll]
    for i in 0..ra {
        let row = ty + i * UNITS;
        let r = r0 + row;
        if r < gq {
            let h = kh * group + r / q_len;
            let qi = r % q_len;
            let base = b * p.o.b as usize + h * p.o.h as usize + qi * p.o.s as usize;
            let active = vis_s[row] > 0u32;
            let lv = l_s[row];
            #[unroll(unroll)]
            for ch in 0..nch {
                #[unroll]
                for c in 0..2usize {
                    let col = ch * DC + tx + c * UNITS;
                    if col < d {
                        let val = select(
                            active,
                            div_rn(o[i * ncol + ch * 2 + c], lv, emulate),
                            0.0f32,
                        );
                        out[base + col * p.o.d as usize] = F::cast_from(val);
                    }
                }
            }
        }
    }
}
