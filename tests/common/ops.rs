//! Backend-generic suites of `attention` and `rms_norm`: values and gradients against f64 on
//! shapes that are multiples of no tile, and bitwise invariance (decode = prefill, alone =
//! batch, ragged = unpadded, chunked = one call, rerun, padding rows change no gradient).
use burn::tensor::{DType, Int, Tensor, backend::AutodiffBackend, backend::Backend};
use burn_invariant::{
    AttentionOptions, InvariantBackend, InvariantError, attention, attention_with_lens, rms_norm,
};

use super::{Rng, assert_bits_eq, bits, float, ints, values};

/// Sizes of one attention problem.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
}

/// Query, key and value of `dims` from `seed`, in `dtype`.
pub fn qkv<B: Backend>(device: &B::Device, dtype: DType, d: Dims, seed: u64) -> [Tensor<B, 4>; 3] {
    let mut rng = Rng::new(seed);
    let q = [d.batch, d.heads, d.q_len, d.head_dim];
    let kv = [d.batch, d.kv_heads, d.kv_len, d.head_dim];
    // cubecl's CUDA upload refuses the zero strides of an empty shape: allocate those instead.
    let mut make = |shape: [usize; 4]| match shape.iter().product() {
        0 => Tensor::empty(shape, (device, dtype)),
        len => float(rng.vec(len, 1.0), shape, device, dtype),
    };
    [make(q), make(kv), make(kv)]
}

/// Plain softmax attention in f64 on the stored values; `[B, H, Q, D]`.
pub fn attention_f64(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d: Dims,
    kv_lens: &[usize],
    causal: bool,
    scale: f64,
) -> Vec<f64> {
    let hd = d.head_dim;
    let mut out = vec![0.0; q.len()];
    for (b, &kv_len_b) in kv_lens.iter().enumerate().take(d.batch) {
        for h in 0..d.heads {
            let kh = h / (d.heads / d.kv_heads);
            for i in 0..d.q_len {
                let pos = kv_len_b as i64 - d.q_len as i64 + i as i64;
                if pos < 0 {
                    continue;
                }
                let n = if causal { pos as usize + 1 } else { kv_len_b };
                let qo = ((b * d.heads + h) * d.q_len + i) * hd;
                let ko = |j: usize| ((b * d.kv_heads + kh) * d.kv_len + j) * hd;
                let s: Vec<f64> = (0..n)
                    .map(|j| (0..hd).map(|t| q[qo + t] * k[ko(j) + t]).sum::<f64>() * scale)
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for t in 0..hd {
                    out[qo + t] = (0..n).map(|j| e[j] * v[ko(j) + t]).sum::<f64>() / z;
                }
            }
        }
    }
    out
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 | DType::F64 => 2e-5,
        DType::F16 => 4e-3,
        _ => 3e-2,
    }
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1.0f64, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}[{i}]: got {g}, want {w} (tolerance {tol} × {scale})"
        );
    }
}

fn lens<B: Backend>(l: &[usize], device: &B::Device) -> Tensor<B, 1, Int> {
    ints::<B>(l.iter().map(|&x| x as i64).collect(), device)
}

/// Values against f64: causal and not, GQA, ragged `kv_lens` with empty and short rows, negative
/// and zero scales; head sizes 64 and 128 are those of the tensor-core forward (f16/bf16 on CUDA).
pub fn attention_values<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    for head_dim in [40, 64, 128] {
        attention_values_at::<B>(device, dtype, head_dim);
    }
}

fn attention_values_at<B: InvariantBackend>(device: &B::Device, dtype: DType, head_dim: usize) {
    let d = Dims {
        batch: 3,
        heads: 4,
        kv_heads: 2,
        q_len: 5,
        kv_len: 77,
        head_dim,
    };
    let kv_lens = [77, 3, 0];
    // The default scale, a negative one (Sm90 runs it as -q with |scale|) and 0 (every score 0).
    let default = 1.0 / (d.head_dim as f64).sqrt();
    for (causal, scale) in [
        (true, default),
        (false, default),
        (true, -0.3),
        (false, -0.3),
        (true, 0.0),
    ] {
        let [q, k, v] = qkv::<B>(device, dtype, d, 11);
        let want = attention_f64(
            &values(q.clone()),
            &values(k.clone()),
            &values(v.clone()),
            d,
            &kv_lens,
            causal,
            scale as f32 as f64,
        );
        let opts = AttentionOptions::default()
            .with_causal(causal)
            .with_scale(scale);
        let out = attention(q, k, v, Some(lens::<B>(&kv_lens, device)), &opts).unwrap();
        assert_eq!(out.dtype(), dtype);
        assert_close(
            &format!("attention {dtype:?} D={head_dim} causal={causal} scale={scale}"),
            &values(out),
            &want,
            tolerance(dtype),
        );
    }
}

/// Rows `[b, h, i, :]` of `t [B, H, Q, D]` for `i` in `range`, flattened.
fn query_rows<B: Backend>(
    t: Tensor<B, 4>,
    b: usize,
    range: std::ops::Range<usize>,
) -> Tensor<B, 4> {
    let [_, h, _, d] = t.dims();
    t.slice([b..b + 1, 0..h, range, 0..d])
}

/// KV-cache decode (one query at a time over the keys so far, garbage past them) = causal
/// prefill = chunked prefill = the sequence alone, bitwise; reruns equal.
/// At a head size of the portable kernels only (24) and at the Sm90 ones' (64, 128: 128-key
/// blocks, so the positions straddle 64 and 128 and the chunks a block boundary).
pub fn attention_decode_equals_prefill<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let positions = [0, 1, 63, 64, 65, 127, 128, 129, 139];
    for head_dim in [24, 64, 128] {
        attention_decode_equals_prefill_at::<B>(device, dtype, head_dim, 140, &positions, 130);
    }
}

/// Past one split of the portable forward (`ATTENTION_KEY_SPLIT`, 1024 keys): decode (on CUDA's
/// tensor cores one cube per split and a merge) = prefill (each cube folding its splits) =
/// chunked prefill, bitwise, at the split boundaries.
pub fn attention_split_decode_equals_prefill<B: InvariantBackend>(
    device: &B::Device,
    dtype: DType,
) {
    let positions = [0, 1023, 1024, 1025, 2047, 2048, 2099];
    attention_decode_equals_prefill_at::<B>(device, dtype, 16, 2100, &positions, 1030);
}

/// Past one split of the Sm90 forward (4096 keys; CubeCl's every 1024): decode (one CTA per
/// split and a merge) = prefill (each CTA merging its splits) = chunked prefill, bitwise. On
/// GPUs only (4300² scores).
pub fn attention_long_decode_equals_prefill<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let positions = [0, 1023, 1024, 1025, 4095, 4096, 4097, 4299];
    attention_decode_equals_prefill_at::<B>(device, dtype, 128, 4300, &positions, 4100);
}

/// A sequence of `len` tokens: decode at `positions` and chunks split at 30 and `split` against
/// one causal prefill.
fn attention_decode_equals_prefill_at<B: InvariantBackend>(
    device: &B::Device,
    dtype: DType,
    head_dim: usize,
    len: usize,
    positions: &[usize],
    split: usize,
) {
    let cap = len + 11;
    let d = Dims {
        batch: 1,
        heads: 4,
        kv_heads: 1,
        q_len: len,
        kv_len: len,
        head_dim,
    };
    let [q, k, v] = qkv::<B>(device, dtype, d, 21);
    let opts = AttentionOptions::default();
    let prefill = attention(q.clone(), k.clone(), v.clone(), None, &opts).unwrap();
    let again = attention(q.clone(), k.clone(), v.clone(), None, &opts).unwrap();
    assert_bits_eq("attention rerun", &bits(again), &bits(prefill.clone()));
    // A cache of `cap` positions: the sequence, then NaN past it.
    let pad = float::<B, 4>(
        vec![f32::NAN; (cap - len) * head_dim],
        [1, 1, cap - len, head_dim],
        device,
        dtype,
    );
    let k_cache = Tensor::cat(vec![k.clone(), pad.clone()], 2);
    let v_cache = Tensor::cat(vec![v.clone(), pad], 2);
    for &t in positions {
        let step = attention(
            query_rows(q.clone(), 0, t..t + 1),
            k_cache.clone(),
            v_cache.clone(),
            Some(lens::<B>(&[t + 1], device)),
            &opts,
        )
        .unwrap();
        assert_bits_eq(
            &format!("decode position {t} vs prefill (head_dim {head_dim})"),
            &bits(step),
            &bits(query_rows(prefill.clone(), 0, t..t + 1)),
        );
    }
    // Chunked prefill: queries 0..30, 30..split, split..len, each over the keys so far.
    let bounds = [0, 30, split, len];
    let chunks = bounds.windows(2).map(|w| {
        attention(
            query_rows(q.clone(), 0, w[0]..w[1]),
            k_cache.clone(),
            v_cache.clone(),
            Some(lens::<B>(&[w[1]], device)),
            &opts,
        )
        .unwrap()
    });
    assert_bits_eq(
        &format!("chunked prefill vs one call (head_dim {head_dim})"),
        &bits(Tensor::cat(chunks.collect(), 2)),
        &bits(prefill),
    );
}

/// A sequence alone = the same sequence in a ragged batch (other rows longer and shorter, NaN
/// past each row's keys), bitwise.
pub fn attention_batch_invariance<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    for head_dim in [16, 64, 128] {
        attention_batch_invariance_at::<B>(device, dtype, head_dim);
    }
}

fn attention_batch_invariance_at<B: InvariantBackend>(
    device: &B::Device,
    dtype: DType,
    head_dim: usize,
) {
    let d = Dims {
        batch: 3,
        heads: 2,
        kv_heads: 2,
        q_len: 9,
        kv_len: 200,
        head_dim,
    };
    let [q, k, v] = qkv::<B>(device, dtype, d, 31);
    let kv_lens = [200, 9, 141];
    // NaN past each row's keys.
    let mask: Vec<f32> = (0..d.batch)
        .flat_map(|b| {
            (0..d.kv_heads * d.kv_len * d.head_dim).map(move |e| {
                if (e / d.head_dim) % d.kv_len < kv_lens[b] {
                    0.0
                } else {
                    f32::NAN
                }
            })
        })
        .collect();
    let mask = float::<B, 4>(
        mask,
        [d.batch, d.kv_heads, d.kv_len, d.head_dim],
        device,
        dtype,
    );
    let (k, v) = (k + mask.clone(), v + mask);
    let opts = AttentionOptions::default();
    let batch = attention(
        q.clone(),
        k.clone(),
        v.clone(),
        Some(lens::<B>(&kv_lens, device)),
        &opts,
    )
    .unwrap();
    let host = attention_with_lens(q.clone(), k.clone(), v.clone(), &kv_lens, &opts).unwrap();
    assert_bits_eq(
        &format!("attention_with_lens vs kv_lens as a tensor (head_dim {head_dim})"),
        &bits(host),
        &bits(batch.clone()),
    );
    for (b, &len) in kv_lens.iter().enumerate() {
        let row = |t: Tensor<B, 4>, l: usize| {
            let [_, h, _, hd] = t.dims();
            t.slice([b..b + 1, 0..h, 0..l, 0..hd])
        };
        let alone = attention(
            row(q.clone(), d.q_len),
            row(k.clone(), len),
            row(v.clone(), len),
            None,
            &opts,
        )
        .unwrap();
        assert_bits_eq(
            &format!("row {b} alone vs in the ragged batch (head_dim {head_dim})"),
            &bits(alone),
            &bits(query_rows(batch.clone(), b, 0..d.q_len)),
        );
    }
    let finite = values(batch).iter().all(|x| x.is_finite());
    assert!(finite, "NaN past kv_lens leaked into the output");
}

/// `(out, dq, dk, dv)` of `sum(attention(q, k, v) · upstream)`.
fn attention_grads<B: InvariantBackend + AutodiffBackend>(
    [q, k, v]: [Tensor<B, 4>; 3],
    kv_lens: Option<Tensor<B, 1, Int>>,
    upstream: Tensor<B, 4>,
    opts: &AttentionOptions,
) -> [Tensor<B::InnerBackend, 4>; 4] {
    let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
    let out = attention(q.clone(), k.clone(), v.clone(), kv_lens, opts).unwrap();
    let grads = (out.clone() * upstream).sum().backward();
    [
        out.inner(),
        q.grad(&grads).unwrap(),
        k.grad(&grads).unwrap(),
        v.grad(&grads).unwrap(),
    ]
}

/// Gradients against f64 (analytic softmax-attention gradients on the stored values), at the
/// default scale and a negative one.
pub fn attention_gradients<B: InvariantBackend + AutodiffBackend>(
    device: &B::Device,
    dtype: DType,
) {
    for head_dim in [12, 64, 128] {
        attention_gradients_at::<B>(device, dtype, head_dim);
    }
}

fn attention_gradients_at<B: InvariantBackend + AutodiffBackend>(
    device: &B::Device,
    dtype: DType,
    head_dim: usize,
) {
    let d = Dims {
        batch: 2,
        heads: 4,
        kv_heads: 2,
        q_len: 7,
        kv_len: 69,
        head_dim,
    };
    let kv_lens = [69, 5];
    let [q, k, v] = qkv::<B>(device, dtype, d, 41);
    let mut rng = Rng::new(42);
    let up = float::<B, 4>(
        rng.vec(d.batch * d.heads * d.q_len * d.head_dim, 1.0),
        [d.batch, d.heads, d.q_len, d.head_dim],
        device,
        dtype,
    );
    let (qv, kvv, vv, upv) = (
        values(q.clone()),
        values(k.clone()),
        values(v.clone()),
        values(up.clone()),
    );
    // The default scale and a negative one (Sm90's forward runs it as -q with |scale|).
    let default = (1.0 / (d.head_dim as f64).sqrt()) as f32 as f64;
    for scale in [default, -0.3] {
        let opts = AttentionOptions::default().with_scale(scale);
        let lens = Some(lens::<B>(&kv_lens, device));
        let qkv = [q.clone(), k.clone(), v.clone()];
        let [_, dq, dk, dv] = attention_grads(qkv, lens, up.clone(), &opts);
        let scale = scale as f32 as f64;
        let (wq, wk, wv) = attention_grads_f64(&qv, &kvv, &vv, &upv, d, &kv_lens, scale);
        let tol = 10.0 * tolerance(dtype);
        for (what, got, want) in [("dQuery", dq, wq), ("dKey", dk, wk), ("dValue", dv, wv)] {
            let what = format!("{what} (head_dim {head_dim}, scale {scale})");
            assert_close(&what, &values(got), &want, tol);
        }
    }
}

/// Causal attention gradients in f64.
fn attention_grads_f64(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    g: &[f64],
    d: Dims,
    kv_lens: &[usize],
    scale: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let hd = d.head_dim;
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    for (b, &kv_len_b) in kv_lens.iter().enumerate().take(d.batch) {
        for h in 0..d.heads {
            let kh = h / (d.heads / d.kv_heads);
            for i in 0..d.q_len {
                let pos = kv_len_b as i64 - d.q_len as i64 + i as i64;
                if pos < 0 {
                    continue;
                }
                let n = pos as usize + 1;
                let qo = ((b * d.heads + h) * d.q_len + i) * hd;
                let ko = |j: usize| ((b * d.kv_heads + kh) * d.kv_len + j) * hd;
                let s: Vec<f64> = (0..n)
                    .map(|j| (0..hd).map(|t| q[qo + t] * k[ko(j) + t]).sum::<f64>() * scale)
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp() / z).collect();
                let dp: Vec<f64> = (0..n)
                    .map(|j| (0..hd).map(|t| g[qo + t] * v[ko(j) + t]).sum())
                    .collect();
                let delta: f64 = (0..n).map(|j| p[j] * dp[j]).sum();
                for j in 0..n {
                    let ds = p[j] * (dp[j] - delta) * scale;
                    for t in 0..hd {
                        dq[qo + t] += ds * k[ko(j) + t];
                        dk[ko(j) + t] += ds * q[qo + t];
                        dv[ko(j) + t] += p[j] * g[qo + t];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}

/// Backward invariance as a trainer pads: a causal sequence of 20 alone vs right-padded to 25
/// (other values in the padding's queries, keys and values, zero upstream gradient there):
/// dQuery, dKey and dValue of the real positions bitwise equal, zero at the padding; reruns
/// equal. The padding is NaN at head size 8 (the FMA kernels skip what a query does not see)
/// and finite at 64, where tensor-core kernels (CubeCl's forward on CUDA, Sm90) multiply a key a
/// query does not see by p = 0 (docs/CONTRACT.md, *attention semantics*).
pub fn attention_backward_invariance<B: InvariantBackend + AutodiffBackend>(
    device: &B::Device,
    dtype: DType,
) {
    for head_dim in [8, 64] {
        attention_backward_invariance_at::<B>(device, dtype, head_dim);
    }
}

fn attention_backward_invariance_at<B: InvariantBackend + AutodiffBackend>(
    device: &B::Device,
    dtype: DType,
    hd: usize,
) {
    let (len, padded) = (20, 25);
    let d = Dims {
        batch: 1,
        heads: 2,
        kv_heads: 1,
        q_len: len,
        kv_len: len,
        head_dim: hd,
    };
    let [q, k, v] = qkv::<B>(device, dtype, d, 51);
    let mut rng = Rng::new(52);
    let up = float::<B, 4>(rng.vec(2 * len * hd, 1.0), [1, 2, len, hd], device, dtype);
    let opts = AttentionOptions::default();
    let [_, dq, dk, dv] =
        attention_grads([q.clone(), k.clone(), v.clone()], None, up.clone(), &opts);
    let [_, dq2, dk2, dv2] =
        attention_grads([q.clone(), k.clone(), v.clone()], None, up.clone(), &opts);
    assert_bits_eq("dKey rerun", &bits(dk2), &bits(dk.clone()));
    assert_bits_eq("dValue rerun", &bits(dv2), &bits(dv.clone()));
    assert_bits_eq("dQuery rerun", &bits(dq2), &bits(dq.clone()));
    let extra = padded - len;
    let mut garbage = Rng::new(53);
    let mut filler = |heads: usize| {
        let values = if hd == 8 {
            vec![f32::NAN; heads * extra * hd]
        } else {
            garbage.vec(heads * extra * hd, 8.0)
        };
        float::<B, 4>(values, [1, heads, extra, hd], device, dtype)
    };
    let mut pad = |t: Tensor<B, 4>, heads: usize| Tensor::cat(vec![t, filler(heads)], 2);
    let up_pad = Tensor::cat(
        vec![up, Tensor::zeros([1, 2, extra, hd], (device, dtype))],
        2,
    );
    let [_, dq_pad, dk_pad, dv_pad] =
        attention_grads([pad(q, 2), pad(k, 1), pad(v, 1)], None, up_pad, &opts);
    let real =
        |t: Tensor<B::InnerBackend, 4>, heads: usize| t.slice([0..1, 0..heads, 0..len, 0..hd]);
    let tail = |t: Tensor<B::InnerBackend, 4>, heads: usize| {
        values(t.slice([0..1, 0..heads, len..padded, 0..hd]))
    };
    assert_bits_eq(
        "dKey with right padding",
        &bits(real(dk_pad.clone(), 1)),
        &bits(dk),
    );
    assert_bits_eq(
        "dValue with right padding",
        &bits(real(dv_pad.clone(), 1)),
        &bits(dv),
    );
    assert_bits_eq(
        "dQuery with right padding",
        &bits(real(dq_pad.clone(), 2)),
        &bits(dq),
    );
    for (what, t, heads) in [
        ("dKey", dk_pad, 1),
        ("dValue", dv_pad, 1),
        ("dQuery", dq_pad, 2),
    ] {
        assert!(
            tail(t, heads).iter().all(|&x| x == 0.0),
            "{what} of the padding is not zero"
        );
    }
}

/// Bad input: every case a typed error naming the argument, never a panic.
pub fn attention_bad_input<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let d = Dims {
        batch: 2,
        heads: 4,
        kv_heads: 2,
        q_len: 3,
        kv_len: 5,
        head_dim: 8,
    };
    let [q, k, v] = qkv::<B>(device, dtype, d, 61);
    let opts = AttentionOptions::default();
    let arg = |r: Result<Tensor<B, 4>, InvariantError>| match r {
        Err(InvariantError::Shape { arg, .. } | InvariantError::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected a shape or argument error, got {other:?}"),
    };
    let k3 = float::<B, 4>(vec![0.0; 2 * 3 * 5 * 8], [2, 3, 5, 8], device, dtype);
    assert_eq!(
        arg(attention(q.clone(), k3.clone(), k3, None, &opts)),
        "key"
    );
    let k_dim = float::<B, 4>(vec![0.0; 2 * 2 * 5 * 7], [2, 2, 5, 7], device, dtype);
    assert_eq!(
        arg(attention(q.clone(), k_dim.clone(), k_dim, None, &opts)),
        "key"
    );
    let v_short = float::<B, 4>(vec![0.0; 2 * 2 * 4 * 8], [2, 2, 4, 8], device, dtype);
    assert_eq!(
        arg(attention(q.clone(), k.clone(), v_short, None, &opts)),
        "value"
    );
    for bad in [vec![6i64, 1], vec![-1, 2], vec![1, 2, 3]] {
        let r = attention(
            q.clone(),
            k.clone(),
            v.clone(),
            Some(ints::<B>(bad, device)),
            &opts,
        );
        assert_eq!(arg(r), "kv_lens");
    }
    for bad in [vec![6usize, 1], vec![1, 2, 3], vec![]] {
        let r = attention_with_lens(q.clone(), k.clone(), v.clone(), &bad, &opts);
        assert_eq!(arg(r), "kv_lens");
    }
    let v_short = float::<B, 4>(vec![0.0; 2 * 2 * 4 * 8], [2, 2, 4, 8], device, dtype);
    assert_eq!(
        arg(attention_with_lens(
            q.clone(),
            k.clone(),
            v_short,
            &[5, 5],
            &opts
        )),
        "value"
    );
    let long = float::<B, 4>(vec![0.0; 2 * 4 * 6 * 8], [2, 4, 6, 8], device, dtype);
    assert_eq!(
        arg(attention(long, k.clone(), v.clone(), None, &opts)),
        "query"
    );
    let nan_scale = AttentionOptions::default().with_scale(f64::NAN);
    assert_eq!(
        arg(attention(q.clone(), k.clone(), v.clone(), None, &nan_scale)),
        "scale"
    );
    // Zero sizes run.
    for z in [
        Dims { batch: 0, ..d },
        Dims { q_len: 0, ..d },
        Dims { head_dim: 0, ..d },
    ] {
        let [q, k, v] = qkv::<B>(device, dtype, z, 62);
        let out = attention(q, k, v, None, &opts).unwrap();
        assert_eq!(out.dims(), [z.batch, z.heads, z.q_len, z.head_dim]);
    }
    let empty = Dims {
        kv_len: 0,
        q_len: 0,
        ..d
    };
    let [q, k, v] = qkv::<B>(device, dtype, empty, 63);
    let out = attention(q, k, v, None, &opts.with_causal(false)).unwrap();
    assert_eq!(out.dims(), [2, 4, 0, 8]);
}

fn rms_f64(x: &[f64], gamma: &[f64], eps: f64) -> Vec<f64> {
    let d = gamma.len();
    x.chunks(d)
        .flat_map(|row| {
            let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
            row.iter()
                .zip(gamma)
                .map(move |(v, g)| v * r * g)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// RMSNorm values against f64, and row invariance (a row alone = among others), bitwise.
pub fn rms_norm_values<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    for (n, d) in [(1, 1), (5, 257), (3, 600), (2, 4100)] {
        let mut rng = Rng::new(70 + d as u64);
        let x = float::<B, 3>(rng.vec(n * d, 2.0), [1, n, d], device, dtype);
        let gamma = float::<B, 1>(rng.vec(d, 1.5), [d], device, dtype);
        let want = rms_f64(&values(x.clone()), &values(gamma.clone()), 1e-5);
        let y = rms_norm(x.clone(), gamma.clone(), 1e-5).unwrap();
        assert_eq!(y.dims(), [1, n, d]);
        assert_close(
            &format!("rms_norm [{n}, {d}]"),
            &values(y.clone()),
            &want,
            tolerance(dtype) * 4.0,
        );
        let last = rms_norm(x.clone().slice([0..1, n - 1..n, 0..d]), gamma, 1e-5).unwrap();
        assert_bits_eq(
            &format!("rms_norm [{n}, {d}] last row alone"),
            &bits(last),
            &bits(y.slice([0..1, n - 1..n, 0..d])),
        );
    }
}

/// RMSNorm gradients against f64 (finite differences of the f64 function are avoided: the
/// analytic gradient), `dGamma` unchanged by appended zero-gradient rows holding NaN, `dX`
/// row-invariant, reruns equal.
pub fn rms_norm_gradients<B: InvariantBackend + AutodiffBackend>(device: &B::Device, dtype: DType) {
    let (n, d, eps) = (7, 300, 1e-5);
    let mut rng = Rng::new(80);
    let x = float::<B, 2>(rng.vec(n * d, 2.0), [n, d], device, dtype);
    let gamma = float::<B, 1>(rng.vec(d, 1.5), [d], device, dtype);
    let up = float::<B, 2>(rng.vec(n * d, 1.0), [n, d], device, dtype);
    let grads = |x: Tensor<B, 2>, up: Tensor<B, 2>| {
        let (x, gamma) = (x.require_grad(), gamma.clone().require_grad());
        let y = rms_norm(x.clone(), gamma.clone(), eps).unwrap();
        let g = (y * up).sum().backward();
        (x.grad(&g).unwrap(), gamma.grad(&g).unwrap())
    };
    let (dx, dgamma) = grads(x.clone(), up.clone());
    let (xv, gv, uv) = (values(x.clone()), values(gamma.clone()), values(up.clone()));
    let (mut wx, mut wg) = (vec![0.0; n * d], vec![0.0; d]);
    for r in 0..n {
        let row = &xv[r * d..(r + 1) * d];
        let u = &uv[r * d..(r + 1) * d];
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
        let dot: f64 = (0..d).map(|t| u[t] * gv[t] * row[t]).sum();
        for t in 0..d {
            wx[r * d + t] = inv * u[t] * gv[t] - row[t] * inv.powi(3) * dot / d as f64;
            wg[t] += u[t] * row[t] * inv;
        }
    }
    let tol = 10.0 * tolerance(dtype);
    assert_close("rms_norm dX", &values(dx.clone()), &wx, tol);
    assert_close("rms_norm dGamma", &values(dgamma.clone()), &wg, tol);
    let (dx2, dgamma2) = grads(x.clone(), up.clone());
    assert_bits_eq("rms_norm dX rerun", &bits(dx2), &bits(dx.clone()));
    assert_bits_eq(
        "rms_norm dGamma rerun",
        &bits(dgamma2),
        &bits(dgamma.clone()),
    );
    let extra = 300;
    let x_pad = Tensor::cat(
        vec![
            x,
            float::<B, 2>(vec![f32::NAN; extra * d], [extra, d], device, dtype),
        ],
        0,
    );
    let up_pad = Tensor::cat(vec![up, Tensor::zeros([extra, d], (device, dtype))], 0);
    let (dx_pad, dgamma_pad) = grads(x_pad, up_pad);
    assert_bits_eq(
        "rms_norm dGamma with zero-gradient rows",
        &bits(dgamma_pad),
        &bits(dgamma),
    );
    assert_bits_eq(
        "rms_norm dX rows with appended rows",
        &bits(dx_pad.slice([0..n, 0..d])),
        &bits(dx),
    );
}

/// RMSNorm bad input: typed errors naming the argument.
pub fn rms_norm_bad_input<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let x = float::<B, 2>(vec![1.0; 6], [2, 3], device, dtype);
    let arg = |r: Result<Tensor<B, 2>, InvariantError>| match r {
        Err(InvariantError::Shape { arg, .. } | InvariantError::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected a shape or argument error, got {other:?}"),
    };
    let gamma4 = float::<B, 1>(vec![1.0; 4], [4], device, dtype);
    assert_eq!(arg(rms_norm(x.clone(), gamma4, 1e-5)), "gamma");
    let gamma = float::<B, 1>(vec![1.0; 3], [3], device, dtype);
    for eps in [f64::NAN, -1.0, f64::INFINITY] {
        assert_eq!(arg(rms_norm(x.clone(), gamma.clone(), eps)), "eps");
    }
    let empty = float::<B, 2>(vec![], [0, 3], device, dtype);
    assert_eq!(rms_norm(empty, gamma, 1e-5).unwrap().dims(), [0, 3]);
}
