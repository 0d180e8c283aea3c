#![allow(unused_macros)] // the shared test module's suite macro is not used here
//! Valid inputs that used to fail past validation: targets of every integer dtype, and a hidden
//! size D = 0. On the NdArray reference and, with the `wgpu` feature, on wgpu raw and under
//! Fusion (lavapipe in CI).
mod common;

use burn::tensor::{DType, IntDType, Tensor, backend::AutodiffBackend};
use burn_invariant::{InvariantBackend, LinearLogpOptions};
use common::{bits, float, ints};

/// `(logp, lse, dHidden, dWeight, dBias)` bits of `linear_logp_with_lse` and its backward, with
/// the targets cast to `targets_dtype`.
fn run<B: AutodiffBackend + InvariantBackend>(
    device: &B::Device,
    [n, d, v]: [usize; 3],
    targets: &[i64],
    targets_dtype: IntDType,
) -> [Vec<u64>; 5] {
    let values = |count: usize, seed: usize| -> Vec<f32> {
        (0..count)
            .map(|i| ((i * 7 + seed) % 13) as f32 / 13.0 - 0.4)
            .collect()
    };
    let hidden = float::<B, 2>(values(n * d, 1), [n, d], device, DType::F32).require_grad();
    let weight = float::<B, 2>(values(v * d, 2), [v, d], device, DType::F32).require_grad();
    let bias = float::<B, 1>(values(v, 3), [v], device, DType::F32).require_grad();
    let targets = ints::<B>(targets.to_vec(), device).cast(targets_dtype);
    let options = LinearLogpOptions::default().with_ignore_index(-1);
    let (logp, lse) = burn_invariant::linear_logp_with_lse(
        hidden.clone(),
        weight.clone(),
        targets,
        Some(bias.clone()),
        &options,
    )
    .expect("linear_logp_with_lse");
    let grads = (logp.clone() * 0.7 + lse.clone() * 0.3).sum().backward();
    let grad = |t: Tensor<B, 2>| bits(t.grad(&grads).expect("a gradient"));
    [
        bits(logp),
        bits(lse),
        grad(hidden),
        grad(weight),
        bits(bias.grad(&grads).expect("a bias gradient")),
    ]
}

/// Every integer dtype Burn has on NdArray.
const ALL_INTS: [IntDType; 7] = [
    IntDType::I32,
    IntDType::I16,
    IntDType::I8,
    IntDType::U64,
    IntDType::U32,
    IntDType::U16,
    IntDType::U8,
];

/// Targets of each dtype in `dtypes` (those the backend can hold) give the bits of i64 targets.
fn targets_of_every_int_dtype<B: AutodiffBackend + InvariantBackend>(
    device: &B::Device,
    dtypes: &[IntDType],
) {
    let targets = [0, 5, -1, 7, 2, 5, 1];
    let want = run::<B>(device, [7, 9, 11], &targets, IntDType::I64);
    for &dtype in dtypes {
        // Unsigned dtypes cannot hold the ignore index -1: use a valid target there.
        let unsigned = matches!(
            dtype,
            IntDType::U64 | IntDType::U32 | IntDType::U16 | IntDType::U8
        );
        let targets: Vec<i64> = if unsigned {
            targets.iter().map(|&t| t.max(3)).collect()
        } else {
            targets.to_vec()
        };
        let want = if unsigned {
            run::<B>(device, [7, 9, 11], &targets, IntDType::I64)
        } else {
            want.clone()
        };
        let got = run::<B>(device, [7, 9, 11], &targets, dtype);
        assert_eq!(got, want, "targets as {dtype:?}");
    }
}

/// D = 0: the logits are the bias alone; `dBias` is the softmax gradient, the others are empty.
fn zero_hidden_size<B: AutodiffBackend + InvariantBackend>(device: &B::Device) {
    type Reference = burn::backend::Autodiff<burn_ndarray::NdArray<f32>>;
    let targets = [3, 0, -1, 4];
    let got = run::<B>(device, [4, 0, 6], &targets, IntDType::I64);
    let want = run::<Reference>(&Default::default(), [4, 0, 6], &targets, IntDType::I64);
    assert!(
        got[2].is_empty() && got[3].is_empty(),
        "empty dHidden, dWeight"
    );
    let close = |a: &[u64], b: &[u64]| {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| (f64::from_bits(*x) - f64::from_bits(*y)).abs() < 1e-5)
    };
    for (what, i) in [("logp", 0), ("lse", 1), ("dBias", 4)] {
        assert!(
            close(&got[i], &want[i]),
            "{what}: {:?} vs {:?}",
            got[i],
            want[i]
        );
    }
}

mod ndarray {
    type B = burn::backend::Autodiff<burn_ndarray::NdArray<f32>>;

    #[test]
    fn targets_of_every_int_dtype() {
        super::targets_of_every_int_dtype::<B>(&Default::default(), &super::ALL_INTS);
    }

    #[test]
    fn zero_hidden_size() {
        super::zero_hidden_size::<B>(&Default::default());
    }
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use std::sync::OnceLock;

    use burn::tensor::IntDType;
    use burn_wgpu::{WgpuDevice, WgpuRuntime};

    type Raw = burn::backend::Autodiff<burn_cubecl::CubeBackend<WgpuRuntime, f32, i32, u32>>;
    type Fused = burn::backend::Autodiff<
        burn_fusion::Fusion<burn_cubecl::CubeBackend<WgpuRuntime, f32, i32, u32>>,
    >;

    fn device() -> Option<WgpuDevice> {
        static CELL: OnceLock<Option<WgpuDevice>> = OnceLock::new();
        super::common::probe(&CELL, "wgpu", "BURN_INVARIANT_REQUIRE_WGPU", || {
            let device = WgpuDevice::DefaultDevice;
            let _ = <WgpuRuntime as cubecl::Runtime>::client(&device);
            Some(device)
        })
    }

    #[test]
    fn targets_of_every_int_dtype() {
        if let Some(device) = device() {
            // WGSL has no 8- or 16-bit integers, and no 64-bit unsigned ones.
            let dtypes = [IntDType::I32, IntDType::U32];
            super::targets_of_every_int_dtype::<Raw>(&device, &dtypes);
            super::targets_of_every_int_dtype::<Fused>(&device, &dtypes);
        }
    }

    #[test]
    fn zero_hidden_size() {
        if let Some(device) = device() {
            super::zero_hidden_size::<Raw>(&device);
            super::zero_hidden_size::<Fused>(&device);
        }
    }
}
