//! GPU report: time and TFLOP/s of each implementation on CUDA (and Burn's own `matmul`), one
//! machine-readable `RESULT` line per case, to be set side by side with cuBLAS
//! (`benches/cublas_reference.py`, same shapes, same run; `benches/compare.py` joins them).
//!
//! Beside each primitive case, the same work through the public API as a user runs it: under
//! `Autodiff<Fusion<CubeBackend<Cuda, bf16>>>`, the implementation forced with
//! `BURN_INVARIANT_IMPL`, calls queued and one sync per batch (`impl=<Impl>Api`; `linear_logp`
//! with `skip_target_check`, whose host read of the targets would sync every call).
//! `rl`: the RL head (`linear_logp` at temperature 0.7, with and without entropy) beside the
//! plain call, timed in turn over 5 rounds (medians), primitives and public API
//! (`linear_logp_full`), names `<Impl>+T0.7[+ent]`.
//! `sample`: `linear_sample` through the public API under `User` (Sm90, then CubeCl forced) at
//! N = 64 and 4096, D = 4096, V = 128256: Gumbel-max, greedy and top-50 beside `linear_logp_full`
//! (the same pass without a draw), on flat logits (every column's noise computed) and peaked ones
//! (most columns too far below the best to need noise); `benches/sample_reference.py` times
//! cuBLAS and PyTorch's sampling at the same shapes. `--rows 4096` (or 64) keeps one N, so that a
//! profiler's first launch of a kernel is that N's.
//! `memory`: device memory around one forward + backward (cubecl's in-use and reserved bytes, and
//! `nvidia-smi`'s figure for this process), `MEMORY` lines.
//!
//! `cargo bench --features cuda --bench gpu_report [matmul|logp|api|rl|memory|wgpu]` (`wgpu`: built
//! with `wgpu` or `vulkan`) (needs an NVIDIA
//! GPU; prints a notice and exits 0 without one). Timing: warm-up, then the median over
//! repetitions of a device-synced batch of launches, on random data.
use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Distribution, Int, Tensor, TensorData, backend::Backend};
use burn_invariant::{
    InvariantBackend, LinearLogpOptions,
    backend::{GradRequest, LinearLogpInputs, LogpHead},
    ops::{linear_logp::LinearLogpOps, matmul::MatmulOps},
    registry::Implementation,
};

#[cfg(feature = "cuda")]
type B = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
/// What a user trains on: autodiff over fusion over the bf16 CUDA backend.
#[cfg(feature = "cuda")]
type User = burn::backend::Autodiff<
    burn_fusion::Fusion<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, half::bf16, i32, u8>>,
>;

const PROJECTIONS: [(usize, usize); 5] = [
    (4096, 12288),
    (4096, 4096),
    (4096, 14336),
    (14336, 4096),
    (4096, 32000),
];
const VOCABS: [usize; 3] = [32768, 50257, 131072];

/// Median seconds per call of `f` (each repetition: `batch` calls, then a device sync), after
/// at least 200 ms of warm-up calls so the GPU clocks have left their idle state.
fn time<Bk: Backend>(device: &Bk::Device, batch: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    let warm = Instant::now();
    while warm.elapsed().as_secs_f64() < 0.2 {
        f();
        Bk::sync(device).expect("sync");
    }
    let mut samples: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..batch {
                f();
            }
            Bk::sync(device).expect("sync");
            start.elapsed().as_secs_f64() / batch as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[reps / 2]
}

/// Rounds of the RL heads' interleaved timing.
const HEAD_ROUNDS: usize = 5;

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn report(what: &str, imp: &str, shape: &str, seconds: f64, flops: f64) {
    println!(
        "RESULT op={what} impl={imp} {shape} ms={:.4} tflops={:.1}",
        seconds * 1e3,
        flops / seconds / 1e12
    );
}

fn random<Bk: Backend, const D: usize>(
    shape: [usize; D],
    device: &Bk::Device,
    scale: f64,
) -> Tensor<Bk, D> {
    random_as(shape, device, scale, DType::BF16)
}

fn random_as<Bk: Backend, const D: usize>(
    shape: [usize; D],
    device: &Bk::Device,
    scale: f64,
    dtype: DType,
) -> Tensor<Bk, D> {
    Tensor::<Bk, D>::random(shape, Distribution::Uniform(-scale, scale), device).cast(dtype)
}

/// `n` targets spread over the vocabulary: `(7919 · i) mod v`.
fn spread_targets<Bk: Backend>(n: usize, v: usize, device: &Bk::Device) -> Tensor<Bk, 1, Int> {
    let values: Vec<i64> = (0..n as i64).map(|i| (i * 7919) % v as i64).collect();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

/// The report's name of a float dtype.
fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    }
}

/// CubeCl through wgpu (Vulkan / SPIR-V where built with `vulkan`): `matmul` at M = 4096 and
/// `linear_logp` forward and forward + backward, f16 (the dtype Vulkan cooperative matrices
/// take), primitive calls; `impl=CubeClWgpu`.
#[cfg(feature = "wgpu")]
fn wgpu_cases() {
    type W = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u8>;
    let device = cubecl::wgpu::WgpuDevice::DefaultDevice;
    let dtype = DType::F16;
    let client = <cubecl::wgpu::WgpuRuntime as cubecl::Runtime>::client(&device);
    println!(
        "WGPU path: matmul {:?}; linear_logp on tensor cores: {}",
        burn_invariant_cubecl::matmul_path(&client, dtype.into(), 4096, 4096),
        burn_invariant_cubecl::linear_logp_tensor_cores(&client, dtype.into())
    );
    let prim = |t: &Tensor<W, 2>| t.clone().into_primitive().tensor();
    let imp = Implementation::CubeCl;
    for (k, n) in PROJECTIONS {
        let m = 4096;
        let lhs = random_as::<W, 2>([m, k], &device, 1.0, dtype);
        let rhs = random_as::<W, 2>([k, n], &device, 0.05, dtype);
        let s = time::<W>(&device, 10, 7, || {
            let _ = W::invariant_matmul(prim(&lhs), prim(&rhs), None, imp);
        });
        let shape = format!("dtype={} m={m} k={k} n={n}", dtype_name(dtype));
        report("matmul", "CubeClWgpu", &shape, s, 2.0 * (m * k * n) as f64);
    }
    logp_cases_as::<W>(&device, dtype, &[(imp, "CubeClWgpu")], PLAIN);
}

fn matmul_cases<Bk: InvariantBackend>(device: &Bk::Device) {
    let prim = |t: &Tensor<Bk, 2>| t.clone().into_primitive().tensor();
    for (k, n) in PROJECTIONS {
        let rhs = random::<Bk, 2>([k, n], device, 0.05);
        for m in [4096usize, 64, 16, 1] {
            let lhs = random::<Bk, 2>([m, k], device, 1.0);
            let shape = format!("dtype=bf16 m={m} k={k} n={n}");
            let flops = 2.0 * (m * k * n) as f64;
            let batch = if m == 4096 { 10 } else { 50 };
            for imp in [Implementation::Sm90, Implementation::CubeCl] {
                if imp == Implementation::CubeCl && m != 4096 {
                    continue;
                }
                let s = time::<Bk>(device, batch, 7, || {
                    let _ = Bk::invariant_matmul(prim(&lhs), prim(&rhs), None, imp);
                });
                report("matmul", &format!("{imp:?}"), &shape, s, flops);
            }
            if m == 4096 {
                let s = time::<Bk>(device, batch, 7, || {
                    let _ = lhs.clone().matmul(rhs.clone());
                });
                report("matmul", "BurnMatmul", &shape, s, flops);
                // Backward: dLhs = g·rhsᵀ and dRhs = lhsᵀ·g.
                let grad = random::<Bk, 2>([m, n], device, 1.0);
                let s = time::<Bk>(device, 5, 7, || {
                    let _ = Bk::invariant_matmul_grad_lhs(
                        prim(&grad),
                        prim(&rhs),
                        Implementation::Sm90,
                    );
                    let _ = Bk::invariant_matmul_grad_rhs(
                        prim(&lhs),
                        prim(&grad),
                        Implementation::Sm90,
                    );
                });
                report("matmul_backward", "Sm90", &shape, s, 2.0 * flops);
            }
        }
    }
}

/// The plain head: temperature 1, no entropy.
const PLAIN: &[(LogpHead, &str)] = &[(LogpHead::PLAIN, "")];

/// The RL heads, each beside the plain one: temperature 0.7, then with entropy.
const RL_HEADS: &[(LogpHead, &str)] = &[
    (LogpHead::PLAIN, ""),
    (
        LogpHead {
            inv_temperature: 1.0 / 0.7,
            entropy: false,
        },
        "+T0.7",
    ),
    (
        LogpHead {
            inv_temperature: 1.0 / 0.7,
            entropy: true,
        },
        "+T0.7+ent",
    ),
];

fn logp_cases<Bk: InvariantBackend>(device: &Bk::Device, heads: &[(LogpHead, &str)]) {
    logp_cases_as::<Bk>(
        device,
        DType::BF16,
        &[
            (Implementation::Sm90, "Sm90"),
            (Implementation::CubeCl, "CubeCl"),
        ],
        heads,
    );
}

fn logp_cases_as<Bk: InvariantBackend>(
    device: &Bk::Device,
    dtype: DType,
    imps: &[(Implementation, &str)],
    heads: &[(LogpHead, &str)],
) {
    let (n, d) = (4096usize, 2048usize);
    for v in VOCABS {
        let hidden = random_as::<Bk, 2>([n, d], device, 1.0, dtype);
        let weight = random_as::<Bk, 2>([v, d], device, 0.05, dtype);
        let targets = spread_targets::<Bk>(n, v, device);
        let inputs = |head: LogpHead| LinearLogpInputs::<Bk> {
            hidden: hidden.clone().into_primitive().tensor(),
            weight: weight.clone().into_primitive().tensor(),
            bias: None,
            targets: targets.clone().into_primitive(),
            ignore_index: None,
            head,
        };
        let shape = format!("dtype={} n={n} d={d} v={v}", dtype_name(dtype));
        let flops = 2.0 * (n * d * v) as f64;
        for &(imp, name) in imps {
            let reps = if imp == Implementation::Sm90 { 7 } else { 3 };
            // Several heads: timed in turn, round after round, so clock and thermal drift hit
            // each alike; each reports its median over the rounds.
            let rounds = if heads.len() > 1 { HEAD_ROUNDS } else { 1 };
            let mut samples = vec![[Vec::new(), Vec::new()]; heads.len()];
            for _ in 0..rounds {
                for (&(head, _), [fwd, fwd_bwd]) in heads.iter().zip(&mut samples) {
                    fwd.push(time::<Bk>(device, 3, reps, || {
                        let _ = Bk::invariant_linear_logp(inputs(head), imp);
                    }));
                    let grad: Tensor<Bk, 2> = Tensor::random(
                        [n, head.columns()],
                        Distribution::Uniform(-1.0, 1.0),
                        device,
                    );
                    fwd_bwd.push(time::<Bk>(device, 2, reps, || {
                        let stats = Bk::invariant_linear_logp(inputs(head), imp);
                        let _ = Bk::invariant_linear_logp_backward(
                            inputs(head),
                            stats,
                            grad.clone().into_primitive().tensor(),
                            GradRequest::ALL,
                            imp,
                        );
                    }));
                }
            }
            for (&(_, suffix), [fwd, fwd_bwd]) in heads.iter().zip(samples) {
                let name = format!("{name}{suffix}");
                report("linear_logp_fwd", &name, &shape, median(fwd), flops);
                report(
                    "linear_logp_fwd_bwd",
                    &name,
                    &shape,
                    median(fwd_bwd),
                    4.0 * flops,
                );
            }
        }
    }
}

/// The RL head through the public API under `User`: `linear_logp_full` at temperature 0.7 with
/// entropy, forward and forward + backward of `Σ logp + 0.01·Σ entropy`.
fn rl_api_cases<U: AutodiffBackend + InvariantBackend>(device: &U::Device)
where
    U::InnerBackend: InvariantBackend,
{
    let opts = LinearLogpOptions::default()
        .with_skip_target_check(true)
        .with_temperature(0.7)
        .with_entropy(true);
    for imp in [Implementation::Sm90, Implementation::CubeCl] {
        force(imp);
        api_logp_cases::<U>(device, imp, &format!("{imp:?}Api+T0.7+ent"), &opts);
    }
    // SAFETY: as in `force`.
    unsafe { std::env::remove_var("BURN_INVARIANT_IMPL") };
}

/// `linear_logp_full` with `opts` under `U` at N = 4096, D = 2048 for every vocabulary, on the
/// implementation `imp` forced by the caller: forward, and forward + backward of `Σ logp` (plus
/// `0.01·Σ entropy` where the options ask for it).
fn api_logp_cases<U: AutodiffBackend + InvariantBackend>(
    device: &U::Device,
    imp: Implementation,
    name: &str,
    opts: &LinearLogpOptions,
) where
    U::InnerBackend: InvariantBackend,
{
    let rand = |shape: [usize; 2], scale: f64| {
        Tensor::<U, 2>::random(shape, Distribution::Uniform(-scale, scale), device)
            .cast(DType::BF16)
    };
    let (n, d) = (4096usize, 2048usize);
    for v in VOCABS {
        let hidden = rand([n, d], 1.0);
        let weight = rand([v, d], 0.05);
        let targets = spread_targets::<U>(n, v, device);
        let shape = format!("dtype=bf16 n={n} d={d} v={v}");
        let flops = 2.0 * (n * d * v) as f64;
        let reps = if imp == Implementation::Sm90 { 7 } else { 3 };
        let call = |h: &Tensor<U, 2>, w: &Tensor<U, 2>| {
            burn_invariant::linear_logp_full(h.clone(), w.clone(), targets.clone(), None, opts)
                .expect("linear_logp_full")
        };
        let s = time::<U>(device, 3, reps, || {
            let _ = call(&hidden, &weight);
        });
        report("linear_logp_fwd", name, &shape, s, flops);
        let (h, w) = (hidden.clone().require_grad(), weight.clone().require_grad());
        let s = time::<U>(device, 2, reps, || {
            let out = call(&h, &w);
            let loss = match out.entropy {
                Some(entropy) => out.logp.sum() + entropy.sum().mul_scalar(0.01),
                None => out.logp.sum(),
            };
            let grads = loss.backward();
            let _ = (h.grad(&grads), w.grad(&grads));
        });
        report("linear_logp_fwd_bwd", name, &shape, s, 4.0 * flops);
    }
}

/// `linear_sample` through the public API (see the module doc), names
/// `<Impl>Api+<rule>+<flat|peaked>`; the hidden states' scale sets the logits' spread.
fn sample_cases<U: InvariantBackend>(device: &U::Device, rows: Option<usize>) {
    let rand = |shape: [usize; 2], scale: f64| {
        Tensor::<U, 2>::random(shape, Distribution::Uniform(-scale, scale), device)
            .cast(DType::BF16)
    };
    let (d, v) = (4096usize, 128_256usize);
    let weight = rand([v, d], 0.05);
    let base = burn_invariant::SampleOptions::default().with_seed(1);
    let rules = [
        ("gumbel", base.clone()),
        ("greedy", base.clone().with_greedy(true)),
        ("top50", base.with_top_k(50)),
    ];
    for imp in [Implementation::Sm90, Implementation::CubeCl] {
        force(imp);
        for n in [64usize, 4096]
            .into_iter()
            .filter(|&n| rows.is_none_or(|r| r == n))
        {
            let keys: Tensor<U, 1, Int> =
                Tensor::from_data(TensorData::new((0..n as i64).collect(), [n]), device);
            let shape = format!("dtype=bf16 n={n} d={d} v={v}");
            let flops = 2.0 * (n * d * v) as f64;
            let (batch, reps) = if n == 64 { (10, 7) } else { (2, 5) };
            // Logits' standard deviation about 1 (flat) and 10 (peaked).
            for (regime, scale) in [("flat", 1.0), ("peaked", 10.0)] {
                let hidden = rand([n, d], scale);
                let logp = LinearLogpOptions::default().with_skip_target_check(true);
                let s = time::<U>(device, batch, reps, || {
                    let _ = burn_invariant::linear_logp_full(
                        hidden.clone(),
                        weight.clone(),
                        keys.clone(),
                        None,
                        &logp,
                    )
                    .expect("linear_logp_full");
                });
                report(
                    "linear_sample",
                    &format!("{imp:?}Api+logp+{regime}"),
                    &shape,
                    s,
                    flops,
                );
                for (rule, options) in &rules {
                    let s = time::<U>(device, batch, reps, || {
                        let _ = burn_invariant::linear_sample(
                            hidden.clone(),
                            weight.clone(),
                            keys.clone(),
                            None,
                            options,
                        )
                        .expect("linear_sample");
                    });
                    let name = format!("{imp:?}Api+{rule}+{regime}");
                    report("linear_sample", &name, &shape, s, flops);
                }
            }
        }
    }
    // SAFETY: as in `force`.
    unsafe { std::env::remove_var("BURN_INVARIANT_IMPL") };
}

/// Forces `implementation` for the calls that follow (the registry reads the variable per call).
fn force(implementation: Implementation) {
    let name = match implementation {
        Implementation::Sm90 => "sm90",
        Implementation::CubeCl => "cubecl",
        other => panic!("not timed here: {other:?}"),
    };
    // SAFETY: the report is single-threaded; nothing reads the environment concurrently.
    unsafe { std::env::set_var("BURN_INVARIANT_IMPL", name) };
}

/// The public-API cases: `matmul` at M = 4096, `linear_logp` forward and forward + backward
/// (through `linear_logp_full` without entropy: the path `linear_logp` takes).
fn api_cases<U: AutodiffBackend + InvariantBackend>(device: &U::Device)
where
    U::InnerBackend: InvariantBackend,
{
    let rand = |shape: [usize; 2], scale: f64| {
        Tensor::<U, 2>::random(shape, Distribution::Uniform(-scale, scale), device)
            .cast(DType::BF16)
    };
    for imp in [Implementation::Sm90, Implementation::CubeCl] {
        force(imp);
        let name = format!("{imp:?}Api");
        for (k, n) in PROJECTIONS {
            let m = 4096;
            let (lhs, rhs) = (rand([m, k], 1.0), rand([k, n], 0.05));
            let s = time::<U>(device, 10, 7, || {
                let _ = burn_invariant::matmul(lhs.clone(), rhs.clone()).expect("matmul");
            });
            let shape = format!("dtype=bf16 m={m} k={k} n={n}");
            report("matmul", &name, &shape, s, 2.0 * (m * k * n) as f64);
        }
        let opts = LinearLogpOptions::default().with_skip_target_check(true);
        api_logp_cases::<U>(device, imp, &name, &opts);
    }
    // SAFETY: as in `force`.
    unsafe { std::env::remove_var("BURN_INVARIANT_IMPL") };
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

/// Device memory around one primitive forward + backward at D = 1024, V = 131072, bf16: cubecl's
/// in-use and reserved bytes and `nvidia-smi`'s figure, before (inputs allocated) and after
/// (gradients alive), beside the live bytes of the outputs and the largest workspace.
#[cfg(feature = "cuda")]
fn memory_cases(device: &cubecl::cuda::CudaDevice) {
    use cubecl::Runtime;
    let client = cubecl::cuda::CudaRuntime::client(device);
    let usage = || client.memory_usage().expect("memory usage");
    let (d, v) = (1024usize, 131072usize);
    for imp in [Implementation::CubeCl, Implementation::Sm90] {
        for n in [4096usize, 16384] {
            let hidden = random::<B, 2>([n, d], device, 1.0);
            let weight = random::<B, 2>([v, d], device, 0.05);
            let targets = spread_targets::<B>(n, v, device);
            let grad: Tensor<B, 2> =
                Tensor::random([n, 2], Distribution::Uniform(-1.0, 1.0), device);
            B::sync(device).expect("sync");
            let head = LogpHead::PLAIN;
            let (before, smi_before) = (usage(), smi_mib());
            let inputs = || LinearLogpInputs::<B> {
                hidden: hidden.clone().into_primitive().tensor(),
                weight: weight.clone().into_primitive().tensor(),
                bias: None,
                targets: targets.clone().into_primitive(),
                ignore_index: None,
                head,
            };
            let stats = B::invariant_linear_logp(inputs(), imp);
            let grads = B::invariant_linear_logp_backward(
                inputs(),
                stats,
                grad.clone().into_primitive().tensor(),
                GradRequest::ALL,
                imp,
            );
            B::sync(device).expect("sync");
            let (after, smi_after) = (usage(), smi_mib());
            let ws = burn_invariant_cubecl::linear_logp_backward_workspace_len(
                n,
                d,
                v,
                DType::BF16.into(),
                false,
            )
            .expect("workspace");
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            println!(
                "MEMORY impl={imp:?} n={n} d={d} v={v} in_use_before_mib={:.0} in_use_after_mib={:.0} \
                 reserved_before_mib={:.0} reserved_after_mib={:.0} growth_reserved_mib={:.0} \
                 live_out_mib={:.0} cubecl_workspace_mib={:.0} smi_before_mib={:?} smi_after_mib={:?}",
                mib(before.bytes_in_use),
                mib(after.bytes_in_use),
                mib(before.bytes_reserved),
                mib(after.bytes_reserved),
                mib(after.bytes_reserved.saturating_sub(before.bytes_reserved)),
                mib(after.bytes_in_use.saturating_sub(before.bytes_in_use)),
                mib(4 * ws as u64),
                smi_before,
                smi_after,
            );
            drop(grads);
        }
    }
}

/// The GPU report beside cuBLAS (an NVIDIA GPU; `cargo bench` passes `--bench`).
#[derive(clap::Parser)]
struct Args {
    /// One part: matmul, logp, api (the default runs these three), rl, sample or memory.
    part: Option<String>,
    /// `sample` only: time only this N (64 or 4096), so that a profiler's first launch of a
    /// kernel is that N's.
    #[arg(long)]
    rows: Option<usize>,
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
            println!("NOTICE: no CUDA driver; the GPU report needs an NVIDIA GPU");
            return;
        }
        let device = cubecl::cuda::CudaDevice::new(0);
        let filter = args.part.unwrap_or_default();
        if filter.is_empty() || filter == "matmul" {
            matmul_cases::<B>(&device);
        }
        if filter.is_empty() || filter == "logp" {
            logp_cases::<B>(&device, PLAIN);
        }
        if filter == "rl" {
            logp_cases::<B>(&device, RL_HEADS);
            rl_api_cases::<User>(&device);
        }
        if filter.is_empty() || filter == "api" {
            api_cases::<User>(&device);
        }
        if filter == "memory" {
            memory_cases(&device);
        }
        if filter == "sample" {
            sample_cases::<User>(&device, args.rows);
        }
        #[cfg(feature = "wgpu")]
        if filter == "wgpu" {
            wgpu_cases();
        }
    }
    #[cfg(not(feature = "cuda"))]
    println!("NOTICE: build with --features cuda for the GPU report");
}
