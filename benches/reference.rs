//! Criterion benches of the reference ops (the harness the GPU benches extend).
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_invariant::{LinearLogpOptions, linear_logp, matmul};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};

type B = burn::backend::NdArray<f32>;

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

fn tensor(shape: [usize; 2], seed: u64) -> Tensor<B, 2> {
    Tensor::from_data(
        TensorData::new(random(shape[0] * shape[1], seed), shape),
        (&Default::default(), DType::F32),
    )
}

fn bench_matmul(c: &mut Criterion) {
    let mut group = c.benchmark_group("reference_matmul");
    for &(m, k, n) in &[(64, 256, 256), (256, 512, 512)] {
        let (lhs, rhs) = (tensor([m, k], 1), tensor([k, n], 2));
        group.throughput(criterion::Throughput::Elements((2 * m * k * n) as u64));
        group.bench_with_input(
            BenchmarkId::from_parameter(format!("{m}x{k}x{n}")),
            &(),
            |b, _| {
                // into_data forces the result, so the whole op is timed.
                b.iter(|| {
                    matmul(lhs.clone(), rhs.clone())
                        .expect("matmul")
                        .into_data()
                })
            },
        );
    }
    group.finish();
}

fn bench_linear_logp(c: &mut Criterion) {
    let mut group = c.benchmark_group("reference_linear_logp");
    for &(n, d, v) in &[(32, 128, 8192), (64, 256, 32000)] {
        let (hidden, weight) = (tensor([n, d], 3), tensor([v, d], 4));
        let targets = Tensor::<B, 1, Int>::from_data(
            TensorData::new(
                (0..n as i64).map(|i| i * 7 % v as i64).collect::<Vec<_>>(),
                [n],
            ),
            &Default::default(),
        );
        group.throughput(criterion::Throughput::Elements((2 * n * d * v) as u64));
        group.bench_with_input(
            BenchmarkId::from_parameter(format!("{n}x{d}x{v}")),
            &(),
            |b, _| {
                b.iter(|| {
                    linear_logp(
                        hidden.clone(),
                        weight.clone(),
                        targets.clone(),
                        None,
                        &LinearLogpOptions::default(),
                    )
                    .expect("linear_logp")
                    .into_data()
                })
            },
        );
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench_matmul, bench_linear_logp
}
criterion_main!(benches);
