//! Attention and RMSNorm report on CUDA, bf16 (and, with `wgpu`, through wgpu, f16): one
//! machine-readable `RESULT` line per case, to be set beside PyTorch (`benches/sdpa_reference.py`, same shapes; `benches/attention_compare.py`
//! joins the two logs).
//!
//! Implementations (`impl=`):
//! - `Invariant`: the public `burn_invariant::attention` / `rms_norm` on the raw
//!   `CubeBackend<Cuda, bf16>` (forward);
//! - `InvariantUser`: the public functions under `Autodiff<Fusion<CubeBackend<Cuda, bf16>>>`,
//!   forward, and forward + backward with an upstream gradient of ones (`out.backward()`: the
//!   gradients of `out.sum()` without Burn's reduction over `out`, which alone takes 0.4–0.8 ms at
//!   these sizes, more than the op's own overhead; PyTorch's side keeps `.sum()`, a cheap kernel
//!   there); `InvariantUserHostLens`: ragged decode through `attention_with_lens` there (the
//!   lengths from the host, no device read);
//! - `InvariantPrim`: the primitives (`invariant_attention` + `invariant_attention_backward`,
//!   `invariant_rms_norm` + `invariant_rms_norm_backward`) on the raw backend, with the
//!   implementation the registry picks for the device and bf16 (Sm90 attention on Hopper), and a
//!   preallocated upstream gradient: the kernels without the public call's checks (`kv_lens`
//!   given to the public call is read on the host, one sync per call);
//! - `Burn`: Burn's own `burn::tensor::module::attention` on the raw backend (K/V heads
//!   repeated to the query heads beforehand: Burn has no GQA; `is_causal`, bottom-right aligned,
//!   or a bool mask for ragged decode) and plain tensor ops for RMSNorm; `BurnUser`: the same
//!   under `Autodiff<Fusion<..>>` (forward + backward).
//!
//! With `BURN_INVARIANT_IMPL` set, the ours-names get `@<value>` appended. With
//! `ATTN_ASYNC_STAGING=1`, the prefill adds `InvariantAsyncStaging`: `Invariant`'s forward
//! with the CubeCl tensor-core forward copying K and V by `cp.async` in cubes of twelve warps
//! (`with_async_staging`; the same bits), timed in the same process.
//!
//! Cases: causal prefill B = 8, H = 32, KH = 8, Dh = 128 at S = 2048 and 4096 (`op=attn_prefill_fwd`,
//! `attn_prefill_fwd_bwd`); decode B = 64, Q = 1, KV = 4096 with every key valid
//! (`attn_decode_full`) and ragged lengths `1 + b·4095/63` (`attn_decode_ragged`); decode at B 1
//! and 8 over 32768 and 131072 keys (`attn_decode_long`; on Hopper the Sm90 split forwards); RMSNorm
//! [16384, 4096] forward and forward + backward (`rms_norm_fwd`, `rms_norm_fwd_bwd`), with the
//! achieved GB/s (ideal bytes read + written / time) and its fraction of 3.35 TB/s. `memory`:
//! cubecl's in-use and reserved bytes and `nvidia-smi`'s figure around one forward + backward
//! under `Autodiff<Fusion<..>>` (`MEMORY` lines).
//!
//! `cargo bench --features cuda --bench attention_report [prefill|decode|rms|burn|memory|wgpu[,..]]`
//! (default: all of them but `wgpu`, which needs a build with `wgpu` or `vulkan` beside `cuda`,
//! runs on the NVIDIA GPU's wgpu adapter, only when named: the CubeCl kernels through wgpu, f16,
//! `impl=CubeClWgpu` for the public calls and `CubeClWgpuPrim` for the primitives; run it without
//! `BURN_INVARIANT_IMPL`). Timing: the first
//! call (compilation included) decides: over 10 s the case is skipped with a `SKIP` line; then
//! at least 200 ms of warm-up, then the median over 3–7 repetitions of a device-synced batch of
//! calls.
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, DType, Distribution, Int, Tensor, TensorData};
use burn_invariant::ops::attention::{AttentionInputs, AttentionOps};
use burn_invariant::ops::rms_norm::{RmsNormInputs, RmsNormOps};
use burn_invariant::registry::{Implementation, Op, implementation_for};
use burn_invariant::{AttentionOptions, InvariantBackend};

/// The raw bf16 CUDA backend.
#[cfg(feature = "cuda")]
type Raw = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, half::bf16, i32, u8>;
/// What a user trains on: autodiff over fusion over the bf16 CUDA backend.
#[cfg(feature = "cuda")]
type User = burn::backend::Autodiff<burn_fusion::Fusion<Raw>>;

/// Prefill: batch, query heads, KV heads, head size.
/// B, H, KH and Dh of the prefill cases; Dh from `ATTN_PREFILL_HEAD_DIM` (default 128).
fn prefill_dims() -> (usize, usize, usize, usize) {
    let d = std::env::var("ATTN_PREFILL_HEAD_DIM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128);
    (8, 32, 8, d)
}
const PREFILL_SEQS: [usize; 2] = [2048, 4096];
/// Decode: batch, query heads, KV heads, keys, head size (one query per row).
const DECODE: (usize, usize, usize, usize, usize) = (64, 32, 8, 4096, 128);
/// Rows and keys of the long-context decode cases (heads and head size as `DECODE`).
const LONG_DECODE_ROWS: [usize; 2] = [1, 8];
const LONG_DECODE_KEYS: [usize; 2] = [32768, 131072];
/// RMSNorm rows and width.
const RMS: (usize, usize) = (16384, 4096);
const RMS_EPS: f64 = 1e-6;
/// H100 SXM HBM3 bandwidth, GB/s.
const PEAK_GBPS: f64 = 3350.0;
/// A case whose first call takes longer is skipped.
const MAX_CALL_S: f64 = 10.0;
/// Device time the timed repetitions of one case aim at.
const REP_BUDGET_S: f64 = 4.0;
/// Burn's attention materializes `[B, H, Q, KV]` scores: skipped where the estimate of its live
/// bytes (scores × factor below) passes this.
const BURN_MEMORY_LIMIT: f64 = 60.0 * (1u64 << 30) as f64;
const BURN_FWD_SCORE_COPIES: f64 = 4.0;
const BURN_FWD_BWD_SCORE_COPIES: f64 = 10.0;

/// Median seconds per call of `f`, or `None` (a `SKIP` line printed) where the first call takes
/// more than [`MAX_CALL_S`] or a device sync reports an error (a kernel that failed to compile or
/// launch, say: the device's server may stay unusable for the rest of the process).
fn time<Bk: Backend>(device: &Bk::Device, name: &str, f: impl FnMut()) -> Option<f64> {
    match try_time::<Bk>(device, f) {
        Ok(Some(s)) => Some(s),
        Ok(None) => {
            println!("SKIP {name}: the first call took more than {MAX_CALL_S} s");
            None
        }
        Err(e) => {
            let e: String = e.split_whitespace().collect::<Vec<_>>().join(" ");
            let cut = e.char_indices().nth(300).map_or(e.len(), |(i, _)| i);
            println!("SKIP {name}: device error: {}", &e[..cut]);
            None
        }
    }
}

fn try_time<Bk: Backend>(device: &Bk::Device, mut f: impl FnMut()) -> Result<Option<f64>, String> {
    let sync = || Bk::sync(device).map_err(|e| format!("{e:?}"));
    let start = Instant::now();
    f();
    sync()?;
    let first = start.elapsed().as_secs_f64();
    if first > MAX_CALL_S {
        return Ok(None);
    }
    // Warm-up: at least one more call and 200 ms, so the clocks have left their idle state.
    let warm = Instant::now();
    let mut calls = 0usize;
    while calls == 0 || warm.elapsed().as_secs_f64() < 0.2 {
        f();
        sync()?;
        calls += 1;
    }
    let per_call = warm.elapsed().as_secs_f64() / calls as f64;
    let batch = ((0.05 / per_call) as usize).clamp(1, 50);
    let reps = ((REP_BUDGET_S / (per_call * batch as f64)) as usize).clamp(3, 7);
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        for _ in 0..batch {
            f();
        }
        sync()?;
        samples.push(start.elapsed().as_secs_f64() / batch as f64);
    }
    samples.sort_by(f64::total_cmp);
    Ok(Some(samples[reps / 2]))
}

/// One `RESULT` line: time, TFLOP/s where `flops > 0`, GB/s and its fraction of the peak where
/// `bytes > 0`.
fn report(op: &str, imp: &str, shape: &str, seconds: f64, flops: f64, bytes: f64) {
    let mut line = format!("RESULT op={op} impl={imp} {shape} ms={:.4}", seconds * 1e3);
    if flops > 0.0 {
        line += &format!(" tflops={:.1}", flops / seconds / 1e12);
    }
    if bytes > 0.0 {
        let gbps = bytes / seconds / 1e9;
        line += &format!(" gbps={gbps:.0} peak_frac={:.3}", gbps / PEAK_GBPS);
    }
    println!("{line}");
}

/// Times `f` and reports it (or the skip).
#[allow(clippy::too_many_arguments)]
fn case<Bk: Backend>(
    device: &Bk::Device,
    op: &str,
    imp: &str,
    shape: &str,
    flops: f64,
    bytes: f64,
    f: impl FnMut(),
) {
    if let Some(s) = time::<Bk>(device, &format!("op={op} impl={imp} {shape}"), f) {
        report(op, imp, shape, s, flops, bytes);
    }
}

/// Our implementation's name in the report: `name`, with `@<BURN_INVARIANT_IMPL>` where set.
fn ours(name: &str) -> String {
    match std::env::var("BURN_INVARIANT_IMPL") {
        Ok(forced) if !forced.is_empty() => format!("{name}@{forced}"),
        _ => name.to_string(),
    }
}

fn random<Bk: Backend, const D: usize>(shape: [usize; D], device: &Bk::Device) -> Tensor<Bk, D> {
    Tensor::<Bk, D>::random(shape, Distribution::Uniform(-1.0, 1.0), device).cast(DType::BF16)
}

/// `[B, KH, S, Dh]` → `[B, KH·group, S, Dh]`, KV head `g` serving query heads
/// `g·group..(g + 1)·group` (the layout `attention` reads without the copy).
fn repeat_heads<Bk: Backend>(kv: Tensor<Bk, 4>, group: usize) -> Tensor<Bk, 4> {
    let [b, kh, s, d] = kv.dims();
    kv.unsqueeze_dim::<5>(2)
        .expand([b, kh, group, s, d])
        .reshape([b, kh * group, s, d])
}

/// Ragged decode lengths, deterministic over `1..=kv`: `1 + b·(kv − 1)/(B − 1)`.
fn ragged_lens(batch: usize, kv: usize) -> Vec<i64> {
    (0..batch)
        .map(|b| (1 + b * (kv - 1) / (batch - 1).max(1)) as i64)
        .collect()
}

fn int_tensor<Bk: Backend>(values: Vec<i64>, device: &Bk::Device) -> Tensor<Bk, 1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

/// Causal prefill visible (query, key) pairs per (row, head): `S(S + 1)/2`.
fn causal_pairs(s: usize) -> f64 {
    (s * (s + 1) / 2) as f64
}

/// Attention forward FLOPs over `pairs` visible (query, key) pairs of each of `rows_heads`
/// (row, head) couples: `q·k` and `p·v`, 2 FLOPs per multiply-add each. Forward + backward is
/// counted as 3.5× (FlashAttention's convention: five matmuls backward against two forward).
fn attn_flops(rows_heads: usize, pairs: f64, d: usize) -> f64 {
    4.0 * rows_heads as f64 * pairs * d as f64
}

/// One causal forward through the public `attention` with every key valid.
fn public_attention<Bk: InvariantBackend>(q: &Tensor<Bk, 4>, k: &Tensor<Bk, 4>, v: &Tensor<Bk, 4>) {
    let opts = AttentionOptions::default();
    let _ =
        burn_invariant::attention(q.clone(), k.clone(), v.clone(), None, &opts).expect("attention");
}

/// The attention primitives' inputs over `q`, `k`, `v` with `kv_lens`, causal, scale `1/√Dh`.
fn attention_inputs<Bk: Backend>(
    (q, k, v): (&Tensor<Bk, 4>, &Tensor<Bk, 4>, &Tensor<Bk, 4>),
    kv_lens: &Tensor<Bk, 1, Int>,
) -> AttentionInputs<Bk> {
    let d = q.dims()[3];
    AttentionInputs::<Bk> {
        query: q.clone().into_primitive().tensor(),
        key: k.clone().into_primitive().tensor(),
        value: v.clone().into_primitive().tensor(),
        kv_lens: kv_lens.clone().into_primitive(),
        causal: true,
        scale: 1.0 / (d as f32).sqrt(),
    }
}

/// One forward + backward through the attention primitives of `imp`, upstream gradient `grad`.
fn attention_fwd_bwd_prim<Bk: InvariantBackend>(
    inputs: impl Fn() -> AttentionInputs<Bk>,
    grad: &Tensor<Bk, 4>,
    imp: Implementation,
) {
    let saved = Bk::invariant_attention(inputs(), imp);
    let _ = Bk::invariant_attention_backward(
        inputs(),
        saved,
        grad.clone().into_primitive().tensor(),
        imp,
    );
}

/// The RMSNorm primitives' inputs.
fn rms_inputs<Bk: Backend>(x: &Tensor<Bk, 2>, gamma: &Tensor<Bk, 1>) -> RmsNormInputs<Bk> {
    RmsNormInputs::<Bk> {
        x: x.clone().into_primitive().tensor(),
        gamma: gamma.clone().into_primitive().tensor(),
        eps: RMS_EPS as f32,
    }
}

/// One forward + backward through the RMSNorm primitives of `imp`, upstream gradient `dy`.
fn rms_fwd_bwd_prim<Bk: InvariantBackend>(
    (x, gamma): (&Tensor<Bk, 2>, &Tensor<Bk, 1>),
    dy: &Tensor<Bk, 2>,
    imp: Implementation,
) {
    let _ = Bk::invariant_rms_norm(rms_inputs(x, gamma), imp);
    let _ = Bk::invariant_rms_norm_backward(
        rms_inputs(x, gamma),
        dy.clone().into_primitive().tensor(),
        imp,
    );
}

fn prefill_shape(s: usize) -> String {
    let (b, h, kh, d) = prefill_dims();
    format!("dtype=bf16 b={b} h={h} kh={kh} q={s} kv={s} d={d}")
}

fn decode_shape(ragged: bool) -> String {
    let (b, h, kh, kv, d) = DECODE;
    let lens = if ragged { "ragged" } else { "full" };
    format!("dtype=bf16 b={b} h={h} kh={kh} q=1 kv={kv} d={d} lens={lens}")
}

/// The decode case's lengths, visible keys and op name: ragged, or every key valid.
fn decode_case(ragged: bool) -> (Vec<i64>, usize, &'static str) {
    let (b, _, _, kv, _) = DECODE;
    let lens = if ragged {
        ragged_lens(b, kv)
    } else {
        vec![kv as i64; b]
    };
    let visible = lens.iter().map(|&l| l as usize).sum();
    let op = if ragged {
        "attn_decode_ragged"
    } else {
        "attn_decode_full"
    };
    (lens, visible, op)
}

/// Ideal decode bytes: each visible key and value read once per KV head, queries read and
/// outputs written once.
fn decode_bytes(visible_keys: usize) -> f64 {
    let (b, h, kh, _, d) = DECODE;
    (2 * kh * visible_keys * d * 2 + 2 * b * h * d * 2) as f64
}

/// Prefill through our public API: forward on the raw backend and under `User`, forward +
/// backward under `User`, and forward + backward through the primitives on the raw backend.
#[cfg(feature = "cuda")]
fn prefill_cases(device: &cubecl::cuda::CudaDevice) {
    let (b, h, kh, d) = prefill_dims();
    let opts = AttentionOptions::default();
    for s in PREFILL_SEQS {
        fresh_pool(device);
        let shape = prefill_shape(s);
        let flops = attn_flops(b * h, causal_pairs(s), d);
        {
            let q = random::<Raw, 4>([b, h, s, d], device);
            let k = random::<Raw, 4>([b, kh, s, d], device);
            let v = random::<Raw, 4>([b, kh, s, d], device);
            case::<Raw>(
                device,
                "attn_prefill_fwd",
                &ours("Invariant"),
                &shape,
                flops,
                0.0,
                || public_attention(&q, &k, &v),
            );
            if std::env::var("ATTN_ASYNC_STAGING").is_ok_and(|v| v == "1") {
                case::<Raw>(
                    device,
                    "attn_prefill_fwd",
                    &ours("InvariantAsyncStaging"),
                    &shape,
                    flops,
                    0.0,
                    || {
                        burn_invariant_cubecl::attention::with_async_staging(|| {
                            public_attention(&q, &k, &v)
                        })
                    },
                );
            }
            let imp = chosen::<Raw>(Op::Attention, device);
            let lens = int_tensor::<Raw>(vec![s as i64; b], device);
            let grad = random::<Raw, 4>([b, h, s, d], device);
            case::<Raw>(
                device,
                "attn_prefill_fwd_bwd",
                &ours("InvariantPrim"),
                &shape,
                3.5 * flops,
                0.0,
                || attention_fwd_bwd_prim(|| attention_inputs((&q, &k, &v), &lens), &grad, imp),
            );
        }
        let q = random::<User, 4>([b, h, s, d], device);
        let k = random::<User, 4>([b, kh, s, d], device);
        let v = random::<User, 4>([b, kh, s, d], device);
        let name = ours("InvariantUser");
        case::<User>(
            device,
            "attn_prefill_fwd",
            &name,
            &shape,
            flops,
            0.0,
            || public_attention(&q, &k, &v),
        );
        let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
        case::<User>(
            device,
            "attn_prefill_fwd_bwd",
            &name,
            &shape,
            3.5 * flops,
            0.0,
            || {
                fwd_bwd_ours(&q, &k, &v, None, &opts);
            },
        );
    }
}

/// One forward + backward through the public API, upstream gradient ones (the gradient of
/// `out.sum()`); the gradients are taken (and dropped).
fn fwd_bwd_ours<U: AutodiffBackend + InvariantBackend>(
    q: &Tensor<U, 4>,
    k: &Tensor<U, 4>,
    v: &Tensor<U, 4>,
    lens: Option<&Tensor<U, 1, Int>>,
    opts: &AttentionOptions,
) where
    U::InnerBackend: InvariantBackend,
{
    let out = burn_invariant::attention(q.clone(), k.clone(), v.clone(), lens.cloned(), opts)
        .expect("attention");
    let grads = out.backward();
    let _ = (q.grad(&grads), k.grad(&grads), v.grad(&grads));
}

/// Decode through our public API (raw backend and `User`, forward) and the primitives.
#[cfg(feature = "cuda")]
fn decode_cases(device: &cubecl::cuda::CudaDevice) {
    let (b, h, kh, kv, d) = DECODE;
    let opts = AttentionOptions::default();
    let q = random::<Raw, 4>([b, h, 1, d], device);
    let k = random::<Raw, 4>([b, kh, kv, d], device);
    let v = random::<Raw, 4>([b, kh, kv, d], device);
    let (uq, uk, uv) = (
        random::<User, 4>([b, h, 1, d], device),
        random::<User, 4>([b, kh, kv, d], device),
        random::<User, 4>([b, kh, kv, d], device),
    );
    for ragged in [false, true] {
        let (lens, visible, op) = decode_case(ragged);
        let flops = 4.0 * h as f64 * visible as f64 * d as f64;
        let bytes = decode_bytes(visible);
        let shape = decode_shape(ragged);
        // Every key valid: `kv_lens = None` (no host read); ragged: the lengths, which the
        // public call reads on the host.
        let raw_lens = ragged.then(|| int_tensor::<Raw>(lens.clone(), device));
        case::<Raw>(device, op, &ours("Invariant"), &shape, flops, bytes, || {
            let _ =
                burn_invariant::attention(q.clone(), k.clone(), v.clone(), raw_lens.clone(), &opts)
                    .expect("attention");
        });
        let user_lens = ragged.then(|| int_tensor::<User>(lens.clone(), device));
        case::<User>(
            device,
            op,
            &ours("InvariantUser"),
            &shape,
            flops,
            bytes,
            || {
                let _ = burn_invariant::attention(
                    uq.clone(),
                    uk.clone(),
                    uv.clone(),
                    user_lens.clone(),
                    &opts,
                )
                .expect("attention");
            },
        );
        if ragged {
            // The lengths from the host (as a KV cache has them): no device read.
            let host_lens: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
            case::<User>(
                device,
                op,
                &ours("InvariantUserHostLens"),
                &shape,
                flops,
                bytes,
                || {
                    let _ = burn_invariant::attention_with_lens(
                        uq.clone(),
                        uk.clone(),
                        uv.clone(),
                        &host_lens,
                        &opts,
                    )
                    .expect("attention");
                },
            );
        }
        let prim_lens = int_tensor::<Raw>(lens, device);
        let imp = chosen::<Raw>(Op::Attention, device);
        case::<Raw>(
            device,
            op,
            &ours("InvariantPrim"),
            &shape,
            flops,
            bytes,
            || {
                let _ = Raw::invariant_attention(attention_inputs((&q, &k, &v), &prim_lens), imp);
            },
        );
    }
}

/// Long-context decode (`attn_decode_long`): B 1 and 8 rows, one query over 32768 or 131072
/// keys, every key valid; the public call on the raw backend (`Invariant`; on Hopper the Sm90
/// split forwards).
#[cfg(feature = "cuda")]
fn long_decode_cases(device: &cubecl::cuda::CudaDevice) {
    let (_, h, kh, _, d) = DECODE;
    for b in LONG_DECODE_ROWS {
        for kv in LONG_DECODE_KEYS {
            fresh_pool(device);
            let q = random::<Raw, 4>([b, h, 1, d], device);
            let k = random::<Raw, 4>([b, kh, kv, d], device);
            let v = random::<Raw, 4>([b, kh, kv, d], device);
            let shape = format!("dtype=bf16 b={b} h={h} kh={kh} q=1 kv={kv} d={d}");
            let flops = 4.0 * (b * h * kv * d) as f64;
            let bytes = (2 * b * kh * kv * d * 2 + 2 * b * h * d * 2) as f64;
            let call = || public_attention(&q, &k, &v);
            case::<Raw>(
                device,
                "attn_decode_long",
                &ours("Invariant"),
                &shape,
                flops,
                bytes,
                call,
            );
        }
    }
}

fn rms_shape() -> String {
    let (n, d) = RMS;
    format!("dtype=bf16 n={n} d={d}")
}

/// Ideal RMSNorm bytes, bf16: forward reads `x` and `gamma` and writes `y`; backward reads `x`,
/// `dy` and `gamma` and writes `dx` and `dGamma`.
fn rms_bytes(backward: bool) -> f64 {
    let (n, d) = RMS;
    let fwd = (2 * n * d + d) * 2;
    let bwd = (3 * n * d + 2 * d) * 2;
    (if backward { fwd + bwd } else { fwd }) as f64
}

/// RMSNorm through our public API (raw forward, `User` forward and forward + backward of
/// `y.sum()`) and the primitives (forward + backward with a preallocated `dy`).
#[cfg(feature = "cuda")]
fn rms_cases(device: &cubecl::cuda::CudaDevice) {
    let (n, d) = RMS;
    let shape = rms_shape();
    {
        let x = random::<Raw, 2>([n, d], device);
        let gamma = random::<Raw, 1>([d], device);
        case::<Raw>(
            device,
            "rms_norm_fwd",
            &ours("Invariant"),
            &shape,
            0.0,
            rms_bytes(false),
            || {
                let _ =
                    burn_invariant::rms_norm(x.clone(), gamma.clone(), RMS_EPS).expect("rms_norm");
            },
        );
        let imp = chosen::<Raw>(Op::RmsNorm, device);
        case::<Raw>(
            device,
            "rms_norm_fwd",
            &ours("InvariantPrim"),
            &shape,
            0.0,
            rms_bytes(false),
            || {
                let _ = Raw::invariant_rms_norm(rms_inputs(&x, &gamma), imp);
            },
        );
        let dy = random::<Raw, 2>([n, d], device);
        case::<Raw>(
            device,
            "rms_norm_fwd_bwd",
            &ours("InvariantPrim"),
            &shape,
            0.0,
            rms_bytes(true),
            || rms_fwd_bwd_prim((&x, &gamma), &dy, imp),
        );
    }
    let x = random::<User, 2>([n, d], device);
    let gamma = random::<User, 1>([d], device);
    let name = ours("InvariantUser");
    case::<User>(
        device,
        "rms_norm_fwd",
        &name,
        &shape,
        0.0,
        rms_bytes(false),
        || {
            let _ = burn_invariant::rms_norm(x.clone(), gamma.clone(), RMS_EPS).expect("rms_norm");
        },
    );
    let (x, gamma) = (x.require_grad(), gamma.require_grad());
    case::<User>(
        device,
        "rms_norm_fwd_bwd",
        &name,
        &shape,
        0.0,
        rms_bytes(true),
        || {
            let y = burn_invariant::rms_norm(x.clone(), gamma.clone(), RMS_EPS).expect("rms_norm");
            let grads = y.backward();
            let _ = (x.grad(&grads), gamma.grad(&grads));
        },
    );
}

/// RMSNorm in plain Burn tensor ops: `x · (mean(x²) + eps)^(-1/2) · gamma`.
fn burn_rms_norm<Bk: Backend>(x: Tensor<Bk, 2>, gamma: Tensor<Bk, 1>) -> Tensor<Bk, 2> {
    let r = x
        .clone()
        .powi_scalar(2)
        .mean_dim(1)
        .add_scalar(RMS_EPS)
        .sqrt()
        .recip();
    x * r * gamma.unsqueeze::<2>()
}

fn burn_opts(is_causal: bool) -> AttentionModuleOptions {
    AttentionModuleOptions {
        is_causal,
        ..Default::default()
    }
}

/// Runs one of Burn's cases; a panic (out of memory, say) becomes a `SKIP` line.
fn guarded(name: &str, f: impl FnOnce()) {
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        println!("SKIP {name}: panicked (see above)");
    }
}

/// Estimated live bytes of Burn's attention: `copies` `[B, H, Q, KV]` bf16 score tensors.
fn burn_fits(name: &str, b: usize, h: usize, q: usize, kv: usize, copies: f64) -> bool {
    let bytes = (b * h * q * kv * 2) as f64 * copies;
    let fits = bytes <= BURN_MEMORY_LIMIT;
    if !fits {
        println!(
            "SKIP {name}: Burn's attention materializes [B, H, Q, KV] scores; estimated {:.0} GiB \
             (> {:.0} GiB)",
            bytes / (1u64 << 30) as f64,
            BURN_MEMORY_LIMIT / (1u64 << 30) as f64
        );
    }
    fits
}

/// Times `f` like [`case`], then checks one more call's result with `check` and reports the
/// time only where it passes: a failed allocation on cubecl's server thread does not reach the
/// caller, and the calls after it time nothing.
#[allow(clippy::too_many_arguments)]
fn checked_case<Bk: Backend, T>(
    device: &Bk::Device,
    op: &str,
    imp: &str,
    shape: &str,
    flops: f64,
    bytes: f64,
    mut f: impl FnMut() -> T,
    check: impl FnOnce(T) -> Result<(), String>,
) {
    let name = format!("op={op} impl={imp} {shape}");
    let Some(s) = time::<Bk>(device, &name, || {
        let _ = f();
    }) else {
        return;
    };
    match check(f()) {
        Ok(()) => report(op, imp, shape, s, flops, bytes),
        Err(e) => println!("SKIP {name}: the result after timing is invalid: {e}"),
    }
}

/// `Ok` where `t` can be read back and its sum (in f32) is finite.
fn finite<Bk: Backend, const D: usize>(t: Option<Tensor<Bk, D>>) -> Result<(), String> {
    let t = t.ok_or("no tensor")?;
    let data = t
        .cast(DType::F32)
        .sum()
        .try_into_data()
        .map_err(|e| format!("{e:?}"))?;
    let sum = data
        .iter::<f32>()
        .next()
        .ok_or_else(|| "empty".to_string())?;
    if sum.is_finite() {
        Ok(())
    } else {
        Err(format!("sum {sum}"))
    }
}

/// Syncs and hands the memory pool's free pages back, so each of Burn's large cases starts from
/// an empty pool.
#[cfg(feature = "cuda")]
fn fresh_pool(device: &cubecl::cuda::CudaDevice) {
    use cubecl::Runtime;
    if User::sync(device).is_ok() {
        cubecl::cuda::CudaRuntime::client(device).memory_cleanup();
    }
}

/// Burn's `attention` (raw forward, `User` forward + backward) and plain-ops RMSNorm, on the
/// same shapes; the largest first, each from a freshly cleaned memory pool, each result checked
/// after its timing.
#[cfg(feature = "cuda")]
fn burn_cases(device: &cubecl::cuda::CudaDevice) {
    let (b, h, kh, d) = prefill_dims();
    let group = h / kh;
    for s in PREFILL_SEQS.into_iter().rev() {
        let shape = prefill_shape(s);
        let flops = attn_flops(b * h, causal_pairs(s), d);
        let name = format!("op=attn_prefill_fwd impl=Burn {shape}");
        if burn_fits(&name, b, h, s, s, BURN_FWD_SCORE_COPIES) {
            fresh_pool(device);
            guarded(&name, || {
                let q = random::<Raw, 4>([b, h, s, d], device);
                let k = repeat_heads(random::<Raw, 4>([b, kh, s, d], device), group);
                let v = repeat_heads(random::<Raw, 4>([b, kh, s, d], device), group);
                checked_case::<Raw, _>(
                    device,
                    "attn_prefill_fwd",
                    "Burn",
                    &shape,
                    flops,
                    0.0,
                    || {
                        burn::tensor::module::attention(
                            q.clone(),
                            k.clone(),
                            v.clone(),
                            None,
                            None,
                            burn_opts(true),
                        )
                    },
                    |out| finite(Some(out)),
                );
            });
        }
        let name = format!("op=attn_prefill_fwd_bwd impl=BurnUser {shape}");
        if burn_fits(&name, b, h, s, s, BURN_FWD_BWD_SCORE_COPIES) {
            fresh_pool(device);
            guarded(&name, || {
                let q = random::<User, 4>([b, h, s, d], device).require_grad();
                let k =
                    repeat_heads(random::<User, 4>([b, kh, s, d], device), group).require_grad();
                let v =
                    repeat_heads(random::<User, 4>([b, kh, s, d], device), group).require_grad();
                checked_case::<User, _>(
                    device,
                    "attn_prefill_fwd_bwd",
                    "BurnUser",
                    &shape,
                    3.5 * flops,
                    0.0,
                    || {
                        let out = burn::tensor::module::attention(
                            q.clone(),
                            k.clone(),
                            v.clone(),
                            None,
                            None,
                            burn_opts(true),
                        );
                        let grads = out.backward();
                        (q.grad(&grads), k.grad(&grads), v.grad(&grads))
                    },
                    |(dq, dk, dv)| {
                        finite(dq)?;
                        finite(dk)?;
                        finite(dv)
                    },
                );
            });
        }
    }
    let (b, h, kh, kv, d) = DECODE;
    let group = h / kh;
    for ragged in [false, true] {
        let shape = decode_shape(ragged);
        let op = if ragged {
            "attn_decode_ragged"
        } else {
            "attn_decode_full"
        };
        let name = format!("op={op} impl=Burn {shape}");
        if !burn_fits(&name, b, h, 1, kv, BURN_FWD_SCORE_COPIES) {
            continue;
        }
        fresh_pool(device);
        guarded(&name, || {
            let lens = if ragged {
                ragged_lens(b, kv)
            } else {
                vec![kv as i64; b]
            };
            let visible: usize = lens.iter().map(|&l| l as usize).sum();
            let flops = 4.0 * h as f64 * visible as f64 * d as f64;
            let q = random::<Raw, 4>([b, h, 1, d], device);
            let k = repeat_heads(random::<Raw, 4>([b, kh, kv, d], device), group);
            let v = repeat_heads(random::<Raw, 4>([b, kh, kv, d], device), group);
            // Ragged: `true` masks key `j ≥ kv_lens[b]`; full: `is_causal` with one query
            // (bottom-right aligned) sees every key.
            let mask = ragged.then(|| {
                let masked: Vec<bool> = lens
                    .iter()
                    .flat_map(|&l| (0..kv).map(move |j| j as i64 >= l))
                    .collect();
                Tensor::<Raw, 4, Bool>::from_data(TensorData::new(masked, [b, 1, 1, kv]), device)
                    .expand([b, h, 1, kv])
            });
            checked_case::<Raw, _>(
                device,
                op,
                "Burn",
                &shape,
                flops,
                decode_bytes(visible),
                || {
                    burn::tensor::module::attention(
                        q.clone(),
                        k.clone(),
                        v.clone(),
                        mask.clone(),
                        None,
                        burn_opts(!ragged),
                    )
                },
                |out| finite(Some(out)),
            );
        });
    }
    let (n, d) = RMS;
    let shape = rms_shape();
    fresh_pool(device);
    guarded("op=rms_norm_fwd impl=Burn", || {
        let x = random::<Raw, 2>([n, d], device);
        let gamma = random::<Raw, 1>([d], device);
        checked_case::<Raw, _>(
            device,
            "rms_norm_fwd",
            "Burn",
            &shape,
            0.0,
            rms_bytes(false),
            || burn_rms_norm(x.clone(), gamma.clone()),
            |y| finite(Some(y)),
        );
    });
    guarded("op=rms_norm_fwd_bwd impl=BurnUser", || {
        let x = random::<User, 2>([n, d], device).require_grad();
        let gamma = random::<User, 1>([d], device).require_grad();
        checked_case::<User, _>(
            device,
            "rms_norm_fwd_bwd",
            "BurnUser",
            &shape,
            0.0,
            rms_bytes(true),
            || {
                let grads = burn_rms_norm(x.clone(), gamma.clone()).backward();
                (x.grad(&grads), gamma.grad(&grads))
            },
            |(dx, dgamma)| {
                finite(dx)?;
                finite(dgamma)
            },
        );
    });
}

/// This process's device memory as `nvidia-smi` reports it, in MiB (None where it cannot tell).
fn smi_mib() -> Option<u64> {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ])
        .output()
        .ok()?;
    let me = std::process::id().to_string();
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let mut f = l.split(',').map(str::trim);
        (f.next()? == me).then(|| f.next()?.parse().ok())?
    })
}

/// Device memory around one forward + backward under `User` at prefill shapes: ours at every
/// sequence length, Burn's where it fits. cubecl's in-use and reserved bytes and `nvidia-smi`'s
/// figure before (inputs allocated) and after (gradients alive); the growth of the reserved
/// bytes bounds the call's peak from above (the pool only grows during the call).
#[cfg(feature = "cuda")]
fn memory_cases(device: &cubecl::cuda::CudaDevice) {
    use cubecl::Runtime;
    let client = cubecl::cuda::CudaRuntime::client(device);
    let usage = || client.memory_usage().expect("memory usage");
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let (b, h, kh, d) = prefill_dims();
    for s in PREFILL_SEQS {
        for burn in [false, true] {
            let imp = if burn { "BurnUser" } else { "InvariantUser" };
            let name = format!("MEMORY impl={imp} {}", prefill_shape(s));
            if burn && !burn_fits(&name, b, h, s, s, BURN_FWD_BWD_SCORE_COPIES) {
                continue;
            }
            guarded(&name, || {
                User::sync(device).expect("sync");
                client.memory_cleanup();
                let q = random::<User, 4>([b, h, s, d], device).require_grad();
                let (k, v) = (
                    random::<User, 4>([b, kh, s, d], device),
                    random::<User, 4>([b, kh, s, d], device),
                );
                let (k, v) = if burn {
                    (repeat_heads(k, h / kh), repeat_heads(v, h / kh))
                } else {
                    (k, v)
                };
                let (k, v) = (k.require_grad(), v.require_grad());
                User::sync(device).expect("sync");
                let (before, smi_before) = (usage(), smi_mib());
                let out = if burn {
                    burn::tensor::module::attention(
                        q.clone(),
                        k.clone(),
                        v.clone(),
                        None,
                        None,
                        burn_opts(true),
                    )
                } else {
                    burn_invariant::attention(
                        q.clone(),
                        k.clone(),
                        v.clone(),
                        None,
                        &AttentionOptions::default(),
                    )
                    .expect("attention")
                };
                let grads = out.backward();
                let kept = (q.grad(&grads), k.grad(&grads), v.grad(&grads));
                User::sync(device).expect("sync");
                let (after, smi_after) = (usage(), smi_mib());
                println!(
                    "{name} in_use_before_mib={:.0} in_use_after_mib={:.0} \
                     reserved_before_mib={:.0} reserved_after_mib={:.0} growth_reserved_mib={:.0} \
                     smi_before_mib={smi_before:?} smi_after_mib={smi_after:?}",
                    mib(before.bytes_in_use),
                    mib(after.bytes_in_use),
                    mib(before.bytes_reserved),
                    mib(after.bytes_reserved),
                    mib(after.bytes_reserved.saturating_sub(before.bytes_reserved)),
                );
                drop(kept);
            });
        }
    }
}

/// The attention and RMSNorm report (an NVIDIA GPU; `cargo bench` passes `--bench`).
#[derive(clap::Parser)]
struct Args {
    /// Parts, comma-separated: prefill, decode, long, rms, memory, burn, wgpu (default: all but
    /// wgpu).
    #[arg(value_delimiter = ',')]
    parts: Vec<String>,
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    #[cfg(feature = "cuda")]
    {
        let available =
            std::panic::catch_unwind(|| cudarc::driver::result::init().is_ok()).unwrap_or(false);
        if !available {
            println!("NOTICE: no CUDA driver; the attention report needs an NVIDIA GPU");
            return;
        }
        let device = cubecl::cuda::CudaDevice::new(0);
        let has = |what: &str| args.parts.is_empty() || args.parts.iter().any(|p| p == what);
        println!(
            "NOTICE: BURN_INVARIANT_IMPL={:?}",
            std::env::var("BURN_INVARIANT_IMPL").ok()
        );
        if has("prefill") {
            prefill_cases(&device);
        }
        if has("decode") {
            decode_cases(&device);
        }
        if has("long") {
            long_decode_cases(&device);
        }
        if has("rms") {
            rms_cases(&device);
        }
        if has("memory") {
            memory_cases(&device);
        }
        #[cfg(feature = "wgpu")]
        if args.parts.iter().any(|p| p == "wgpu") {
            wgpu_cases();
        }
        // Last: Burn's scores are large, and an out-of-memory panic may leave the device's
        // allocator in a state later cases would inherit.
        if has("burn") {
            burn_cases(&device);
        }
    }
    #[cfg(not(feature = "cuda"))]
    println!("NOTICE: build with --features cuda for the attention report");
}

/// The CubeCl kernels through wgpu (`wgpu`, only when named; Vulkan, with CubeCL's SPIR-V and
/// cooperative matrices where built with `vulkan`): f16, the dtype Vulkan's cooperative
/// matrices take. Prefill forward (public call) and forward + backward (primitives) at the
/// prefill shapes, decode full and ragged (primitives) at the decode shape, RMSNorm forward
/// (public call) and forward + backward (primitives); `impl=CubeClWgpu`, beside the CUDA rows
/// of the same shapes (bf16 there).
#[cfg(feature = "wgpu")]
fn wgpu_cases() {
    type W = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u8>;
    let device = cubecl::wgpu::WgpuDevice::DefaultDevice;
    let imp = Implementation::CubeCl;
    let name = "CubeClWgpu";
    let rand = |shape: &[usize]| -> Tensor<W, 4> {
        let shape: [usize; 4] = shape.try_into().expect("four dims");
        Tensor::<W, 4>::random(shape, Distribution::Uniform(-1.0, 1.0), &device).cast(DType::F16)
    };
    let f16 = |shape: String| shape.replacen("dtype=bf16", "dtype=f16", 1);
    let (b, h, kh, d) = prefill_dims();
    for s in PREFILL_SEQS {
        let shape = f16(prefill_shape(s));
        let flops = attn_flops(b * h, causal_pairs(s), d);
        let (q, k, v) = (
            rand(&[b, h, s, d]),
            rand(&[b, kh, s, d]),
            rand(&[b, kh, s, d]),
        );
        case::<W>(
            &device,
            "attn_prefill_fwd",
            name,
            &shape,
            flops,
            0.0,
            || public_attention(&q, &k, &v),
        );
        let lens = int_tensor::<W>(vec![s as i64; b], &device);
        let grad = rand(&[b, h, s, d]);
        let prim = format!("{name}Prim");
        case::<W>(
            &device,
            "attn_prefill_fwd_bwd",
            &prim,
            &shape,
            3.5 * flops,
            0.0,
            || attention_fwd_bwd_prim(|| attention_inputs((&q, &k, &v), &lens), &grad, imp),
        );
    }
    let (b, h, kh, kv, d) = DECODE;
    let (q, k, v) = (
        rand(&[b, h, 1, d]),
        rand(&[b, kh, kv, d]),
        rand(&[b, kh, kv, d]),
    );
    for ragged in [false, true] {
        let (lens, visible, op) = decode_case(ragged);
        let shape = f16(decode_shape(ragged));
        let lens = int_tensor::<W>(lens, &device);
        let flops = 4.0 * h as f64 * visible as f64 * d as f64;
        let prim = format!("{name}Prim");
        case::<W>(
            &device,
            op,
            &prim,
            &shape,
            flops,
            decode_bytes(visible),
            || {
                let _ = W::invariant_attention(attention_inputs((&q, &k, &v), &lens), imp);
            },
        );
    }
    let (n, d) = RMS;
    let shape = f16(rms_shape());
    let x =
        Tensor::<W, 2>::random([n, d], Distribution::Uniform(-1.0, 1.0), &device).cast(DType::F16);
    let gamma =
        Tensor::<W, 1>::random([d], Distribution::Uniform(-1.0, 1.0), &device).cast(DType::F16);
    case::<W>(
        &device,
        "rms_norm_fwd",
        name,
        &shape,
        0.0,
        rms_bytes(false),
        || {
            let _ = burn_invariant::rms_norm(x.clone(), gamma.clone(), RMS_EPS).expect("rms_norm");
        },
    );
    let dy =
        Tensor::<W, 2>::random([n, d], Distribution::Uniform(-1.0, 1.0), &device).cast(DType::F16);
    let prim = format!("{name}Prim");
    case::<W>(
        &device,
        "rms_norm_fwd_bwd",
        &prim,
        &shape,
        0.0,
        rms_bytes(true),
        || rms_fwd_bwd_prim((&x, &gamma), &dy, imp),
    );
}

/// What the registry runs for `op` on `device` in bf16 (what the public call would run).
fn chosen<Bk: InvariantBackend>(op: Op, device: &Bk::Device) -> Implementation {
    implementation_for::<Bk>(op, device, DType::BF16).expect("an implementation for bf16")
}
