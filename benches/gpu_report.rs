//! GPU report: time and TFLOP/s of each implementation on CUDA (and Burn's own `matmul`), one
//! machine-readable `RESULT` line per case, to be set side by side with cuBLAS
//! (`benches/cublas_reference.py`, same shapes, same run; `benches/compare.py` joins them).
//!
//! `cargo bench --features cuda --bench gpu_report` (needs an NVIDIA GPU; prints a notice and
//! exits 0 without one). Timing: warm-up, then the median over repetitions of a device-synced
//! batch of launches, on random data.
use std::time::Instant;

use burn::tensor::{
    DType, Distribution, Int, Tensor, TensorData, TensorPrimitive, backend::Backend,
};
use burn_invariant::{
    InvariantBackend,
    backend::{GradRequest, LinearLogpInputs},
    registry::Implementation,
};

#[cfg(feature = "cuda")]
type B = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

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
    Tensor::<Bk, D>::random(shape, Distribution::Uniform(-scale, scale), device).cast(DType::BF16)
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

fn logp_cases<Bk: InvariantBackend>(device: &Bk::Device) {
    let (n, d) = (4096usize, 2048usize);
    for v in VOCABS {
        let hidden = random::<Bk, 2>([n, d], device, 1.0);
        let weight = random::<Bk, 2>([v, d], device, 0.05);
        let targets: Tensor<Bk, 1, Int> = Tensor::from_data(
            TensorData::new(
                (0..n as i64)
                    .map(|i| (i * 7919) % v as i64)
                    .collect::<Vec<_>>(),
                [n],
            ),
            device,
        );
        let inputs = || LinearLogpInputs::<Bk> {
            hidden: hidden.clone().into_primitive().tensor(),
            weight: weight.clone().into_primitive().tensor(),
            bias: None,
            targets: targets.clone().into_primitive(),
            ignore_index: None,
        };
        let shape = format!("dtype=bf16 n={n} d={d} v={v}");
        let flops = 2.0 * (n * d * v) as f64;
        for imp in [Implementation::Sm90, Implementation::CubeCl] {
            let reps = if imp == Implementation::Sm90 { 7 } else { 3 };
            let s = time::<Bk>(device, 3, reps, || {
                let _ = Bk::invariant_linear_logp(inputs(), imp);
            });
            report("linear_logp_fwd", &format!("{imp:?}"), &shape, s, flops);
            let stats = Bk::invariant_linear_logp(inputs(), imp);
            let grad: Tensor<Bk, 2> =
                Tensor::random([n, 2], Distribution::Uniform(-1.0, 1.0), device);
            let s = time::<Bk>(device, 2, reps, || {
                let stats = Bk::invariant_linear_logp(inputs(), imp);
                let _ = Bk::invariant_linear_logp_backward(
                    inputs(),
                    stats,
                    grad.clone().into_primitive().tensor(),
                    GradRequest::ALL,
                    imp,
                );
            });
            report(
                "linear_logp_fwd_bwd",
                &format!("{imp:?}"),
                &shape,
                s,
                4.0 * flops,
            );
            let _ = Tensor::<Bk, 2>::from_primitive(TensorPrimitive::Float(stats));
        }
    }
}

fn main() {
    #[cfg(feature = "cuda")]
    {
        let available =
            std::panic::catch_unwind(|| cudarc::driver::result::init().is_ok()).unwrap_or(false);
        if !available {
            println!("NOTICE: no CUDA driver; the GPU report needs an NVIDIA GPU");
            return;
        }
        let device = cubecl::cuda::CudaDevice::new(0);
        let filter = std::env::args()
            .nth(1)
            .filter(|a| !a.starts_with('-'))
            .unwrap_or_default();
        if filter.is_empty() || filter == "matmul" {
            matmul_cases::<B>(&device);
        }
        if filter.is_empty() || filter == "logp" {
            logp_cases::<B>(&device);
        }
    }
    #[cfg(not(feature = "cuda"))]
    println!("NOTICE: build with --features cuda for the GPU report");
}
