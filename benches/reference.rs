//! Criterion benches of `matmul` and `linear_logp`: the `Reference` on NdArray always, and with
//! the `wgpu` feature the `CubeCl` kernels on the default wgpu adapter (any Vulkan/Metal/DX12
//! device; lavapipe on a CPU machine), beside Burn's own `Tensor::matmul` on the same device.
//! Each timed call ends with a device sync (not a read-back), so the whole op is timed.
//!
//! ```text
//! cargo bench --bench reference                      # NdArray only
//! cargo bench --features wgpu --bench reference      # + wgpu
//! ```
use burn::tensor::{DType, Int, Tensor, TensorData, backend::Backend};
use burn_invariant::{InvariantBackend, LinearLogpOptions, linear_logp, matmul};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn tensor<B: Backend>(shape: [usize; 2], seed: u64, device: &B::Device) -> Tensor<B, 2> {
    Tensor::from_data(
        TensorData::new(random(shape[0] * shape[1], seed), shape),
        (device, DType::F32),
    )
}

fn sync<B: Backend>(device: &B::Device) {
    B::sync(device).expect("device sync");
}

/// `matmul` of this crate and Burn's `Tensor::matmul` at a few shapes, f32.
fn bench_matmul<B: InvariantBackend>(c: &mut Criterion, backend: &str, device: &B::Device) {
    let mut group = c.benchmark_group(format!("{backend}_matmul"));
    for &(m, k, n) in &[(64, 256, 256), (256, 512, 512), (257, 1000, 1000)] {
        let (lhs, rhs) = (
            tensor::<B>([m, k], 1, device),
            tensor::<B>([k, n], 2, device),
        );
        group.throughput(criterion::Throughput::Elements((2 * m * k * n) as u64));
        let shape = format!("{m}x{k}x{n}");
        group.bench_with_input(BenchmarkId::new("invariant", &shape), &(), |b, _| {
            b.iter(|| {
                let out = matmul(lhs.clone(), rhs.clone()).expect("matmul");
                sync::<B>(device);
                out
            })
        });
        group.bench_with_input(BenchmarkId::new("burn", &shape), &(), |b, _| {
            b.iter(|| {
                let out = lhs.clone().matmul(rhs.clone());
                sync::<B>(device);
                out
            })
        });
    }
    group.finish();
}

fn bench_linear_logp<B: InvariantBackend>(c: &mut Criterion, backend: &str, device: &B::Device) {
    let mut group = c.benchmark_group(format!("{backend}_linear_logp"));
    for &(n, d, v) in &[(32, 128, 8192), (64, 256, 32000)] {
        let (hidden, weight) = (
            tensor::<B>([n, d], 3, device),
            tensor::<B>([v, d], 4, device),
        );
        let targets = Tensor::<B, 1, Int>::from_data(
            TensorData::new(
                (0..n as i64).map(|i| i * 7 % v as i64).collect::<Vec<_>>(),
                [n],
            ),
            device,
        );
        group.throughput(criterion::Throughput::Elements((2 * n * d * v) as u64));
        group.bench_with_input(
            BenchmarkId::from_parameter(format!("{n}x{d}x{v}")),
            &(),
            |b, _| {
                b.iter(|| {
                    let out = linear_logp(
                        hidden.clone(),
                        weight.clone(),
                        targets.clone(),
                        None,
                        &LinearLogpOptions::default(),
                    )
                    .expect("linear_logp");
                    sync::<B>(device);
                    out
                })
            },
        );
    }
    group.finish();
}

fn reference(c: &mut Criterion) {
    type B = burn::backend::NdArray<f32>;
    let device = Default::default();
    bench_matmul::<B>(c, "reference", &device);
    bench_linear_logp::<B>(c, "reference", &device);
}

#[cfg(feature = "wgpu")]
fn wgpu(c: &mut Criterion) {
    type B = burn_cubecl::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u32>;
    let device = burn_wgpu::WgpuDevice::default();
    // Creating the client panics when there is no adapter: skip with a notice then.
    let init = || {
        let _ = <burn_wgpu::WgpuRuntime as cubecl::Runtime>::client(&device);
    };
    if std::panic::catch_unwind(init).is_err() {
        eprintln!("NOTICE: no wgpu adapter: the wgpu benches are skipped");
        return;
    }
    bench_matmul::<B>(c, "wgpu", &device);
    bench_linear_logp::<B>(c, "wgpu", &device);
}

#[cfg(not(feature = "wgpu"))]
fn wgpu(_: &mut Criterion) {}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = reference, wgpu
}
criterion_main!(benches);
