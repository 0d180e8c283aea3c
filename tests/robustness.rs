#![allow(unused_macros)] // the shared test module's suite macro is not used here
//! Inputs that used to fail or mislead past validation: targets of every integer dtype, a hidden
//! size D = 0, and unchecked targets beyond the i32 range. On the NdArray reference, on wgpu raw
//! and under Fusion (lavapipe in CI; its backends hold i32 targets, so no wide ones), and on
//! CUDA with i64 targets (Sm90 and CubeCl; the GPU run).
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

/// With the target check skipped, a target outside `[0, V)` gives NaN, also when it lies beyond
/// the i32 range (`2^32 + 5` must not be scored as class 5).
fn unchecked_wide_targets_give_nan<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let (n, d, v) = (6, 8, 11);
    let values = |count: usize| -> Vec<f32> {
        (0..count)
            .map(|i| ((i * 5 + 1) % 9) as f32 / 9.0 - 0.5)
            .collect()
    };
    let hidden = float::<B, 2>(values(n * d), [n, d], device, dtype);
    let weight = float::<B, 2>(values(v * d), [v, d], device, dtype);
    let targets = [5, (1i64 << 32) + 5, -5, (1i64 << 40) + 1, -100, 7];
    let options = LinearLogpOptions::default()
        .with_ignore_index(-100)
        .with_skip_target_check(true);
    let logp = burn_invariant::linear_logp(
        hidden,
        weight,
        ints::<B>(targets.to_vec(), device),
        None,
        &options,
    )
    .expect("linear_logp");
    let logp = common::values(logp);
    for (row, want_nan) in [(0, false), (1, true), (2, true), (3, true), (5, false)] {
        assert_eq!(
            logp[row].is_nan(),
            want_nan,
            "row {row}: logp {}",
            logp[row]
        );
    }
    assert_eq!(logp[4], 0.0, "ignored row");
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

    #[test]
    fn unchecked_wide_targets_give_nan() {
        let device = Default::default();
        super::unchecked_wide_targets_give_nan::<B>(&device, burn::tensor::DType::F32);
    }
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use burn::tensor::IntDType;
    use burn_wgpu::WgpuRuntime;

    type Raw = burn::backend::Autodiff<burn_cubecl::CubeBackend<WgpuRuntime, f32, i32, u32>>;
    type Fused = burn::backend::Autodiff<
        burn_fusion::Fusion<burn_cubecl::CubeBackend<WgpuRuntime, f32, i32, u32>>,
    >;

    use super::common::wgpu_device as device;

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

#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::{DType, Tensor};

    type Raw = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i64, u8>;

    use super::common::cuda_device as device;

    /// D = 0 in bf16: the Sm90 kernels refuse it, so the registry's default runs it on CubeCl
    /// (before, the call returned `UnsupportedProblem`). Values against the NdArray reference.
    #[test]
    fn zero_hidden_size_runs_in_bf16() {
        type Ad = burn::backend::Autodiff<Raw>;
        type Reference = burn::backend::Autodiff<burn_ndarray::NdArray<f32>>;
        let Some(device) = device() else { return };
        let bias_values = vec![0.5f32, -0.25, 1.0, 0.0, 0.125, -1.0];
        let targets = vec![3i64, 0, 1, 4];
        let got = logp_lse_dbias::<Ad>(&device, DType::BF16, &bias_values, &targets);
        let want =
            logp_lse_dbias::<Reference>(&Default::default(), DType::F32, &bias_values, &targets);
        for (what, got, want) in [
            ("logp", &got.0, &want.0),
            ("lse", &got.1, &want.1),
            ("dBias", &got.2, &want.2),
        ] {
            let close = got.len() == want.len()
                && got
                    .iter()
                    .zip(want)
                    .all(|(a, b)| (a - b).abs() <= 1e-2 * (1.0 + b.abs()));
            assert!(close, "{what}: {got:?} vs {want:?}");
        }
    }

    /// `(logp, lse, dBias)` of a D = 0 head whose logits are the bias.
    fn logp_lse_dbias<
        B: burn::tensor::backend::AutodiffBackend + burn_invariant::InvariantBackend,
    >(
        device: &B::Device,
        dtype: DType,
        bias: &[f32],
        targets: &[i64],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        use super::common::{float, ints, values};
        let (n, v) = (targets.len(), bias.len());
        // Uploading zero bytes is refused by the CUDA runtime: empty tensors are only allocated.
        let hidden = Tensor::<B, 2>::empty([n, 0], (device, dtype)).require_grad();
        let weight = Tensor::<B, 2>::empty([v, 0], (device, dtype)).require_grad();
        let bias = float::<B, 1>(bias.to_vec(), [v], device, dtype).require_grad();
        let (logp, lse) = burn_invariant::linear_logp_with_lse(
            hidden,
            weight,
            ints::<B>(targets.to_vec(), device),
            Some(bias.clone()),
            &Default::default(),
        )
        .expect("D = 0 is a valid problem");
        let grads = (logp.clone() * 0.7 + lse.clone() * 0.3).sum().backward();
        let d_bias = bias.grad(&grads).expect("a bias gradient");
        (values(logp), values(lse), values(d_bias))
    }

    /// bf16 runs the registry's choice (Sm90 on an H100), f32 the CubeCl kernels.
    #[test]
    fn unchecked_wide_targets_give_nan() {
        if let Some(device) = device() {
            for dtype in [DType::BF16, DType::F16, DType::F32] {
                super::unchecked_wide_targets_give_nan::<Raw>(&device, dtype);
            }
        }
    }
}
