//! Public-call overhead: `burn_invariant::matmul` against the backend primitive it runs
//! (`MatmulOps::invariant_matmul` with the implementation the registry chose), on the same
//! backend, raw `CubeBackend<Cuda>` and `Fusion` of it, at decode sizes (M = 1, 16, 64,
//! K = N = 4096, bf16), with Burn's own `matmul` for scale.
//!
//! Each sample queues a batch of calls and syncs once: `us_per_call` is the wall time per call,
//! `host_us_per_call` the time to enqueue one (what the caller's thread spends). The difference
//! between the public call and the primitive is what validation, the registry and the public
//! wrapper cost. The two outputs are compared bitwise first: a benchmark of the wrong thing
//! exits non-zero.
//!
//! `cargo bench --features cuda --bench call_overhead` (needs an NVIDIA GPU; prints a notice
//! and exits 0 without one).
use std::time::Instant;

use burn::tensor::{DType, Distribution, Tensor, backend::Backend};
use burn_invariant::{
    InvariantBackend,
    registry::{Op, implementation_for},
};

const SHAPES: [(usize, usize, usize); 3] = [(1, 4096, 4096), (16, 4096, 4096), (64, 4096, 4096)];
const BATCH: usize = 200;
const REPS: usize = 15;

/// Medians over `REPS` samples of (wall, host) seconds per call of `f`, after ≥ 200 ms of
/// warm-up so the GPU clocks have left their idle state.
fn time<B: Backend>(device: &B::Device, mut f: impl FnMut()) -> (f64, f64) {
    let warm = Instant::now();
    while warm.elapsed().as_secs_f64() < 0.2 {
        for _ in 0..BATCH {
            f();
        }
        B::sync(device).expect("sync");
    }
    let (mut wall, mut host): (Vec<f64>, Vec<f64>) = (0..REPS)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..BATCH {
                f();
            }
            let enqueued = start.elapsed().as_secs_f64();
            B::sync(device).expect("sync");
            let total = start.elapsed().as_secs_f64();
            (total / BATCH as f64, enqueued / BATCH as f64)
        })
        .unzip();
    wall.sort_by(f64::total_cmp);
    host.sort_by(f64::total_cmp);
    (wall[REPS / 2], host[REPS / 2])
}

fn report(backend: &str, what: &str, (m, k, n): (usize, usize, usize), (wall, host): (f64, f64)) {
    println!(
        "OVERHEAD backend={backend} what={what} m={m} k={k} n={n} us_per_call={:.2} host_us_per_call={:.2}",
        wall * 1e6,
        host * 1e6
    );
}

/// Times the three calls on backend `B`; returns false if the public call and the primitive
/// disagree.
fn cases<B: InvariantBackend>(backend: &str, device: &B::Device) -> bool {
    let prim = |t: &Tensor<B, 2>| t.clone().into_primitive().tensor();
    let mut agree = true;
    for shape @ (m, k, n) in SHAPES {
        let lhs = Tensor::<B, 2>::random([m, k], Distribution::Normal(0.0, 1.0), device)
            .cast(DType::BF16);
        let rhs = Tensor::<B, 2>::random([k, n], Distribution::Normal(0.0, 0.02), device)
            .cast(DType::BF16);
        let implementation =
            implementation_for::<B>(Op::Matmul, device, DType::BF16).expect("an implementation");
        let api = burn_invariant::matmul(lhs.clone(), rhs.clone()).expect("matmul");
        let primitive: Tensor<B, 2> = Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(
            B::invariant_matmul(prim(&lhs), prim(&rhs), None, implementation),
        ));
        let equal = api.into_data().bytes == primitive.into_data().bytes;
        println!(
            "CHECK backend={backend} m={m} implementation={implementation:?} bitwise_equal={equal}"
        );
        agree &= equal;
        let t = time::<B>(device, || {
            let _ = burn_invariant::matmul(lhs.clone(), rhs.clone()).expect("matmul");
        });
        report(backend, "api", shape, t);
        let p = time::<B>(device, || {
            let _ = B::invariant_matmul(prim(&lhs), prim(&rhs), None, implementation);
        });
        report(backend, "primitive", shape, p);
        let b = time::<B>(device, || {
            let _ = lhs.clone().matmul(rhs.clone());
        });
        report(backend, "burn", shape, b);
        println!(
            "OVERHEAD_DELTA backend={backend} m={m} api_minus_primitive_us={:.2} host_api_minus_primitive_us={:.2}",
            (t.0 - p.0) * 1e6,
            (t.1 - p.1) * 1e6
        );
    }
    agree
}

fn main() {
    #[cfg(feature = "cuda")]
    {
        type Raw = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, half::bf16, i32, u8>;
        type Fused = burn_fusion::Fusion<Raw>;
        // Without libcuda, cudarc panics; the notice replaces its message.
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let available =
            std::panic::catch_unwind(|| cudarc::driver::result::init().is_ok()).unwrap_or(false);
        std::panic::set_hook(hook);
        if !available {
            println!("NOTICE: no CUDA driver; the call-overhead bench needs an NVIDIA GPU");
            return;
        }
        let device = cubecl::cuda::CudaDevice::new(0);
        let raw = cases::<Raw>("raw", &device);
        let fused = cases::<Fused>("fusion", &device);
        if !(raw && fused) {
            eprintln!("FAILED: the public call and the primitive gave different bits");
            std::process::exit(1);
        }
    }
    #[cfg(not(feature = "cuda"))]
    println!("NOTICE: build with --features cuda for the call-overhead bench");
}
