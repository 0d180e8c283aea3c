//! Public-call overhead: `burn_invariant::matmul` against the backend primitive it runs
//! (`MatmulOps::invariant_matmul` with the implementation the registry chose), on the same
//! backend, raw `CubeBackend<Cuda>` and `Fusion` of it, at decode sizes (M = 1, 16, 64,
//! K = N = 4096, bf16), with Burn's own `matmul` for scale. Then the rollout's LM head at
//! N = 64 (D = 4096, V = 128256, bf16): `linear_sample` (Gumbel, greedy) and `linear_logp_full`
//! against `invariant_linear_sample` / `invariant_linear_logp`, on raw, `Fusion` and
//! `Autodiff<Fusion>` (the backend of `gpu_report sample`). The timed calls drop their outputs
//! unread: under `Fusion` the fused kernels may then skip writing some of them, so those rows can
//! understate what a caller that reads every output pays; the raw rows run every kernel.
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

use burn::tensor::{
    DType, Distribution, Int, Tensor, TensorData, TensorPrimitive, backend::Backend,
};
use burn_invariant::{
    InvariantBackend, LinearLogpOptions, SampleOptions,
    ops::linear_logp::{LinearLogpInputs, LogpHead},
    ops::linear_sample::{LinearSampleInputs, SampleRule, Sampler},
    registry::{Op, implementation_for},
};

const SHAPES: [(usize, usize, usize); 3] = [(1, 4096, 4096), (16, 4096, 4096), (64, 4096, 4096)];
const BATCH: usize = 200;
/// The LM head of the sampler cases: `(N, D, V)`.
const HEAD: (usize, usize, usize) = (64, 4096, 128_256);
/// Calls per sample of the LM-head cases (each about 0.3 ms of GPU time).
const HEAD_BATCH: usize = 20;
const REPS: usize = 15;

/// Medians over `REPS` samples of (wall, host) seconds per call of `f`, after ≥ 200 ms of
/// warm-up so the GPU clocks have left their idle state.
fn time<B: Backend>(device: &B::Device, f: impl FnMut()) -> (f64, f64) {
    time_batch::<B>(device, BATCH, f)
}

/// [`time`] with `batch` calls per sample.
fn time_batch<B: Backend>(device: &B::Device, batch: usize, mut f: impl FnMut()) -> (f64, f64) {
    let warm = Instant::now();
    while warm.elapsed().as_secs_f64() < 0.2 {
        for _ in 0..batch {
            f();
        }
        B::sync(device).expect("sync");
    }
    let (mut wall, mut host): (Vec<f64>, Vec<f64>) = (0..REPS)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..batch {
                f();
            }
            let enqueued = start.elapsed().as_secs_f64();
            B::sync(device).expect("sync");
            let total = start.elapsed().as_secs_f64();
            (total / batch as f64, enqueued / batch as f64)
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

fn report_head(backend: &str, what: &str, (wall, host): (f64, f64)) {
    let (n, d, v) = HEAD;
    println!(
        "OVERHEAD backend={backend} what={what} n={n} d={d} v={v} us_per_call={:.2} host_us_per_call={:.2}",
        wall * 1e6,
        host * 1e6
    );
}

/// Checks that the public call's `logp` equals the first column of its primitive's output bitwise,
/// then times both (`<what>_api`, `<what>_primitive`).
fn api_and_primitive<B: InvariantBackend>(
    (backend, what): (&str, &str),
    device: &B::Device,
    api: impl Fn() -> Tensor<B, 1>,
    primitive: impl Fn() -> B::FloatTensorPrimitive,
) -> bool {
    let n = HEAD.0;
    let column = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(primitive()))
        .slice([0..n, 0..1])
        .reshape([n]);
    let equal = api().into_data().bytes == column.into_data().bytes;
    println!("CHECK backend={backend} what={what} bitwise_equal={equal}");
    let t = time_batch::<B>(device, HEAD_BATCH, || {
        let _ = api();
    });
    report_head(backend, &format!("{what}_api"), t);
    let p = time_batch::<B>(device, HEAD_BATCH, || {
        let _ = primitive();
    });
    report_head(backend, &format!("{what}_primitive"), p);
    equal
}

/// The LM head at N = 64 on backend `B`: the public `linear_sample` (Gumbel, greedy) and
/// `linear_logp_full` beside the primitives they run. Returns false if a public call's `logp`
/// differs from its primitive's.
fn head_cases<B: InvariantBackend>(backend: &str, device: &B::Device) -> bool {
    let (n, d, v) = HEAD;
    let rand = |shape: [usize; 2]| {
        Tensor::<B, 2>::random(shape, Distribution::Uniform(-0.05, 0.05), device).cast(DType::BF16)
    };
    let (hidden, weight) = (rand([n, d]).mul_scalar(20.0), rand([v, d]));
    let keys =
        Tensor::<B, 1, Int>::from_data(TensorData::new((0..n as i64).collect(), [n]), device);
    let prim = |t: &Tensor<B, 2>| t.clone().into_primitive().tensor();
    let implementation =
        implementation_for::<B>(Op::LinearLogp, device, DType::BF16).expect("an implementation");
    println!("CHECK backend={backend} head implementation={implementation:?}");
    let head = LogpHead::PLAIN;
    let mut agree = true;
    for (name, rule) in [
        ("gumbel", SampleRule::Gumbel),
        ("greedy", SampleRule::Greedy),
    ] {
        let options = SampleOptions::default()
            .with_seed(1)
            .with_greedy(rule == SampleRule::Greedy);
        let inputs = || LinearSampleInputs::<B> {
            hidden: prim(&hidden),
            weight: prim(&weight),
            bias: None,
            keys: keys.clone().into_primitive(),
            head,
            sampler: Sampler { seed: 1, rule },
        };
        agree &= api_and_primitive(
            (backend, &format!("linear_sample_{name}")),
            device,
            || {
                burn_invariant::linear_sample(
                    hidden.clone(),
                    weight.clone(),
                    keys.clone(),
                    None,
                    &options,
                )
                .expect("linear_sample")
                .logp
            },
            || B::invariant_linear_sample(inputs(), implementation),
        );
    }
    let options = LinearLogpOptions::default().with_skip_target_check(true);
    let inputs = || LinearLogpInputs::<B> {
        hidden: prim(&hidden),
        weight: prim(&weight),
        bias: None,
        targets: keys.clone().into_primitive(),
        ignore_index: None,
        head,
    };
    agree &= api_and_primitive(
        (backend, "linear_logp_full"),
        device,
        || {
            burn_invariant::linear_logp_full(
                hidden.clone(),
                weight.clone(),
                keys.clone(),
                None,
                &options,
            )
            .expect("linear_logp_full")
            .logp
        },
        || B::invariant_linear_logp(inputs(), implementation),
    );
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
        let head = head_cases::<Raw>("raw", &device)
            & head_cases::<Fused>("fusion", &device)
            & head_cases::<burn::backend::Autodiff<Fused>>("autodiff_fusion", &device);
        if !(raw && fused && head) {
            eprintln!("FAILED: the public call and the primitive gave different bits");
            std::process::exit(1);
        }
    }
    #[cfg(not(feature = "cuda"))]
    println!("NOTICE: build with --features cuda for the call-overhead bench");
}
