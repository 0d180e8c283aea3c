//! Sizes past the kernels' launch limits run in as many launches as they need, with the bits of
//! smaller calls; sizes past a real limit, another device or a dtype no implementation takes
//! return a typed error before anything runs (docs/CONTRACT.md, *Errors*). wgpu (lavapipe in CI)
//! and CUDA (the device machine).
#![cfg(any(feature = "wgpu", feature = "cuda"))]

#[allow(unused_macros)]
mod common;

use burn::tensor::{DType, Tensor};
use burn_invariant::backend::Problem;
use burn_invariant::registry::{Implementation, Op};
use burn_invariant::{InvariantBackend, InvariantError, LinearLogpOptions};
use common::{Rng, assert_bits_eq, bits, float, ints};

/// One more row than wgpu's 65535 cubes of 64 rows along x: the GEMM and `linear_logp` kernels'
/// grids cover it in two launches.
const PAST_THE_GRID: usize = 65_535 * 64 + 65;

/// Rows `range` of `t`, as a fresh tensor (so a call on it is a separate, smaller call).
fn rows<B: InvariantBackend>(t: &Tensor<B, 2>, range: std::ops::Range<usize>) -> Tensor<B, 2> {
    let d = t.dims()[1];
    let data = t.clone().slice([range.clone(), 0..d]).into_data();
    Tensor::from_data(data, (&t.device(), t.dtype()))
}

/// `linear` over [`PAST_THE_GRID`] rows: every row has the bits it has in a call of its own
/// chunk (the first rows, the rows around the launch boundary, the last ones).
pub fn linear_past_the_grid<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let (n, k, out) = (PAST_THE_GRID, 3, 5);
    let mut rng = Rng::new(71);
    let input = float::<B, 2>(rng.vec(n * k, 1.0), [n, k], device, dtype);
    let weight = float::<B, 2>(rng.vec(k * out, 1.0), [k, out], device, dtype);
    let bias = float::<B, 1>(rng.vec(out, 1.0), [out], device, dtype);
    let all = burn_invariant::linear(input.clone(), weight.clone(), Some(bias.clone())).unwrap();
    for range in [0..64, n - 4000..n - 64, n - 65..n] {
        let part = burn_invariant::linear(
            rows(&input, range.clone()),
            weight.clone(),
            Some(bias.clone()),
        )
        .unwrap();
        assert_bits_eq(
            &format!("linear rows {range:?} of {n}"),
            &bits(all.clone().slice([range, 0..out])),
            &bits(part),
        );
    }
}

/// `linear` with [`PAST_THE_GRID`] output features: the columns past wgpu's 65535 cubes along
/// y (and the bias offset of the second launch) have the bits of a call on those weight columns
/// alone.
pub fn linear_columns_past_the_grid<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let (m, k, n) = (3, 2, PAST_THE_GRID);
    let mut rng = Rng::new(73);
    let input = float::<B, 2>(rng.vec(m * k, 1.0), [m, k], device, dtype);
    let weight = float::<B, 2>(rng.vec(k * n, 1.0), [k, n], device, dtype);
    let bias = float::<B, 1>(rng.vec(n, 1.0), [n], device, dtype);
    let all = burn_invariant::linear(input.clone(), weight.clone(), Some(bias.clone())).unwrap();
    for cols in [0..64, n - 4000..n - 64, n - 65..n] {
        let w = Tensor::<B, 2>::from_data(
            weight.clone().slice([0..k, cols.clone()]).into_data(),
            (device, dtype),
        );
        let b = Tensor::<B, 1>::from_data(
            bias.clone().slice(cols.clone()).into_data(),
            (device, dtype),
        );
        let part = burn_invariant::linear(input.clone(), w, Some(b)).unwrap();
        assert_bits_eq(
            &format!("linear columns {cols:?} of {n}"),
            &bits(all.clone().slice([0..m, cols])),
            &bits(part),
        );
    }
}

/// `linear_logp` over [`PAST_THE_GRID`] rows, with entropy: the same bits per row as a call of
/// its own chunk.
pub fn linear_logp_past_the_grid<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let (n, d, v) = (PAST_THE_GRID, 2, 7);
    let mut rng = Rng::new(72);
    let hidden = float::<B, 2>(rng.vec(n * d, 1.0), [n, d], device, dtype);
    let weight = float::<B, 2>(rng.vec(v * d, 1.0), [v, d], device, dtype);
    let targets: Vec<i64> = (0..n).map(|i| (i * 5 % v) as i64).collect();
    let opts = LinearLogpOptions::default().with_entropy(true);
    let call = |h: Tensor<B, 2>, t: Vec<i64>| {
        let out =
            burn_invariant::linear_logp_full(h, weight.clone(), ints::<B>(t, device), None, &opts)
                .unwrap();
        let entropy = out.entropy.expect("requested");
        [out.logp, out.lse, entropy]
    };
    let all = call(hidden.clone(), targets.clone());
    for range in [0..64, n - 4000..n - 64, n - 65..n] {
        let part = call(
            rows(&hidden, range.clone()),
            targets[range.clone()].to_vec(),
        );
        for (name, (a, p)) in ["logp", "lse", "entropy"].iter().zip(all.iter().zip(part)) {
            assert_bits_eq(
                &format!("linear_logp {name} rows {range:?} of {n}"),
                &bits(a.clone().slice([range.clone()])),
                &bits(p),
            );
        }
    }
}

/// The CubeCl `linear_logp` backward needs an f32 workspace of `N·D + …` elements for f16 / bf16:
/// past 2³¹ the problem is refused with `TooLarge` naming `hidden`, for the forward too (it may be
/// differentiated later, where no error can be returned). f32 needs no such workspace. A
/// vocabulary past 65535 segments is refused naming `weight`.
pub fn backward_workspace_limit<B: InvariantBackend>(device: &B::Device, half: DType) {
    let too_large = Problem::LinearLogp {
        n: 1 << 20,
        d: 2047,
        v: 4096,
    };
    let err = B::check_problem(Implementation::CubeCl, device, half, too_large).unwrap_err();
    assert!(
        matches!(err, InvariantError::TooLarge { arg: "hidden", limit, got, .. } if got > limit),
        "{err}"
    );
    B::check_problem(Implementation::CubeCl, device, DType::F32, too_large).unwrap();
    let fits = Problem::LinearLogp {
        n: 1 << 19,
        d: 2047,
        v: 4096,
    };
    B::check_problem(Implementation::CubeCl, device, half, fits).unwrap();
    // The forward's vocabulary segments (4096 wide), one cube each along y (65535 at most).
    let segments = |v: usize| Problem::LinearLogp { n: 1, d: 1, v };
    let err = B::check_problem(
        Implementation::CubeCl,
        device,
        DType::F32,
        segments(65_536 * 4096),
    )
    .unwrap_err();
    assert!(
        matches!(err, InvariantError::TooLarge { arg: "weight", .. }),
        "{err}"
    );
    B::check_problem(
        Implementation::CubeCl,
        device,
        DType::F32,
        segments(65_535 * 4096),
    )
    .unwrap();
}

/// Arguments on another device: `DeviceMismatch` naming the argument.
pub fn device_mismatch<B: InvariantBackend>(device: &B::Device, other: &B::Device, dtype: DType) {
    let f = |shape: [usize; 2], dev: &B::Device| {
        float::<B, 2>(vec![0.5; shape[0] * shape[1]], shape, dev, dtype)
    };
    let f1 = |n: usize, dev: &B::Device| float::<B, 1>(vec![0.5; n], [n], dev, dtype);
    let mismatch = |err: InvariantError, name: &str| {
        assert!(
            matches!(&err, InvariantError::DeviceMismatch { arg, .. } if *arg == name),
            "{name}: {err}"
        );
    };
    mismatch(
        burn_invariant::matmul(f([3, 4], device), f([4, 2], other)).unwrap_err(),
        "rhs",
    );
    mismatch(
        burn_invariant::linear(f([3, 4], device), f([4, 2], device), Some(f1(2, other)))
            .unwrap_err(),
        "bias",
    );
    let opts = LinearLogpOptions::default();
    let t = |dev: &B::Device| ints::<B>(vec![0, 1, 2], dev);
    let logp = |h, w, t, b| burn_invariant::linear_logp(h, w, t, b, &opts).unwrap_err();
    mismatch(
        logp(f([3, 4], device), f([7, 4], other), t(device), None),
        "weight",
    );
    mismatch(
        logp(f([3, 4], device), f([7, 4], device), t(other), None),
        "targets",
    );
    mismatch(
        logp(
            f([3, 4], device),
            f([7, 4], device),
            t(device),
            Some(f1(7, other)),
        ),
        "bias",
    );
}

/// F64 on a GPU backend: no implementation takes it, a typed error with the reasons, before any
/// tensor is read (`ImplementationUnavailable` where `BURN_INVARIANT_IMPL` forces one).
pub fn f64_has_no_implementation<B: InvariantBackend>(device: &B::Device) {
    for op in [Op::Matmul, Op::LinearLogp] {
        let err =
            burn_invariant::registry::implementation_for::<B>(op, device, DType::F64).unwrap_err();
        assert!(
            matches!(
                &err,
                InvariantError::NoImplementation {
                    dtype: DType::F64,
                    ..
                } | InvariantError::ImplementationUnavailable {
                    dtype: DType::F64,
                    ..
                }
            ),
            "{op:?}: {err}"
        );
    }
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::common::wgpu_device as device;
    use burn::tensor::DType;
    use serial_test::serial;

    type B = burn_cubecl::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u32>;
    type Fused = burn_fusion::Fusion<B>;

    #[test]
    #[serial]
    fn linear_past_the_grid() {
        let Some(device) = device() else { return };
        super::linear_past_the_grid::<B>(&device, DType::F32);
        super::linear_past_the_grid::<Fused>(&device, DType::F16);
        super::linear_columns_past_the_grid::<B>(&device, DType::F32);
    }

    #[test]
    #[serial]
    fn linear_logp_past_the_grid() {
        let Some(device) = device() else { return };
        super::linear_logp_past_the_grid::<B>(&device, DType::F32);
    }

    #[test]
    #[serial]
    fn backward_workspace_limit() {
        let Some(device) = device() else { return };
        super::backward_workspace_limit::<B>(&device, DType::F16);
        super::backward_workspace_limit::<Fused>(&device, DType::F16);
    }

    /// lavapipe serves both the default device and the CPU adapter: two Burn devices (CI). A
    /// machine without a CPU adapter (a GPU's Vulkan driver alone) skips.
    #[test]
    #[serial]
    fn device_mismatch() {
        let Some(device) = device() else { return };
        let other = burn_wgpu::WgpuDevice::Cpu;
        assert_ne!(device, other);
        // Creating the client panics when no such adapter exists.
        let probe = || <burn_wgpu::WgpuRuntime as cubecl::Runtime>::client(&other);
        if std::panic::catch_unwind(probe).is_err() {
            println!("skipped: no CPU wgpu adapter beside the default device");
            return;
        }
        super::device_mismatch::<B>(&device, &other, DType::F32);
        super::device_mismatch::<Fused>(&device, &other, DType::F32);
    }

    #[test]
    #[serial]
    fn f64_has_no_implementation() {
        let Some(device) = device() else { return };
        super::f64_has_no_implementation::<B>(&device);
        super::f64_has_no_implementation::<Fused>(&device);
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::{DType, Tensor};
    use burn_invariant::{InvariantError, LinearLogpOptions};
    use serial_test::serial;

    type B = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

    use super::common::cuda_device as device;

    #[test]
    #[serial]
    fn backward_workspace_limit() {
        let Some(device) = device() else { return };
        super::backward_workspace_limit::<B>(&device, DType::BF16);
    }

    #[test]
    #[serial]
    fn f64_has_no_implementation() {
        let Some(device) = device() else { return };
        super::f64_has_no_implementation::<B>(&device);
        let x = Tensor::<B, 2>::ones([2, 2], (&device, DType::F64));
        let err = burn_invariant::matmul(x.clone(), x).unwrap_err();
        assert!(
            matches!(
                err,
                InvariantError::NoImplementation { .. }
                    | InvariantError::ImplementationUnavailable { .. }
            ),
            "{err}"
        );
    }

    /// Through the public API with the CubeCl kernels (the registry's choice for f16 when Sm90 is
    /// forced off, or on any non-Hopper GPU): the f16 problem past the backward's workspace is
    /// refused before the forward allocates anything.
    #[test]
    #[serial]
    fn cubecl_refuses_a_backward_past_its_workspace() {
        let Some(device) = device() else { return };
        if burn_invariant::registry::forced_implementation()
            != Ok(Some(burn_invariant::registry::Implementation::CubeCl))
        {
            println!("skipped: runs with BURN_INVARIANT_IMPL=cubecl");
            return;
        }
        let (n, d, v) = (1 << 20, 2047, 64);
        let hidden = Tensor::<B, 2>::zeros([n, d], (&device, DType::F16));
        let weight = Tensor::<B, 2>::zeros([v, d], (&device, DType::F16));
        let targets = Tensor::<B, 1, burn::tensor::Int>::zeros([n], &device);
        let err = burn_invariant::linear_logp(
            hidden,
            weight,
            targets,
            None,
            &LinearLogpOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(err, InvariantError::TooLarge { arg: "hidden", .. }),
            "{err}"
        );
    }

    /// Without NVRTC's headers, `Sm90` cannot run, found before anything launches. On a Hopper
    /// GPU, where it is the device's implementation for bf16/f16, the default is then an error
    /// that names the reason and the override (never the portable kernels' other bits), a forced
    /// `sm90` an error, a forced `cubecl` runs; elsewhere the default is CubeCl. Runs the check
    /// below in a child process, whose `CUDA_PATH` names no installation (checked once a process).
    #[test]
    #[serial]
    fn sm90_needs_nvrtc() {
        let Some(_) = device() else { return };
        super::common::run_ignored_in_child(
            "cuda::sm90_without_nvrtc_headers",
            &[("CUDA_PATH", "/nonexistent-cuda")],
            &["BURN_INVARIANT_IMPL"],
        );
    }

    #[test]
    #[ignore = "run by sm90_needs_nvrtc in a child process"]
    fn sm90_without_nvrtc_headers() {
        use burn_invariant::registry::{Implementation, OVERRIDE_ENV, Op, implementation_for};
        let Some(device) = device() else { return };
        assert_eq!(
            std::env::var("CUDA_PATH").as_deref(),
            Ok("/nonexistent-cuda")
        );
        let hopper = {
            use cudarc::driver::{result, sys::CUdevice_attribute::*};
            let dev = result::device::get(device.index as i32).expect("the test's device");
            // SAFETY: plain attribute queries on a valid device handle.
            let major = unsafe {
                result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            };
            let minor = unsafe {
                result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            };
            (major.ok(), minor.ok()) == (Some(9), Some(0))
        };
        let default = implementation_for::<B>(Op::LinearLogp, &device, DType::BF16);
        if hopper {
            let err = default.unwrap_err();
            assert!(
                matches!(&err, InvariantError::ImplementationUnavailable { implementation: Implementation::Sm90, reason, .. }
                    if reason.contains("NVRTC") && reason.contains("BURN_INVARIANT_IMPL=cubecl")),
                "{err}"
            );
        } else {
            assert_eq!(default.unwrap(), Implementation::CubeCl);
        }
        // SAFETY: this child process runs this one test, on one thread.
        unsafe { std::env::set_var(OVERRIDE_ENV, "sm90") };
        let err = implementation_for::<B>(Op::Matmul, &device, DType::BF16).unwrap_err();
        assert!(
            matches!(&err, InvariantError::ImplementationUnavailable { reason, .. } if reason.contains("NVRTC")),
            "{err}"
        );
        // SAFETY: as above.
        unsafe { std::env::set_var(OVERRIDE_ENV, "cubecl") };
        let chosen = implementation_for::<B>(Op::Matmul, &device, DType::BF16).unwrap();
        assert_eq!(chosen, Implementation::CubeCl);
    }

    /// The CubeCl backward at a Qwen2.5-72B head (V = 152064, D = 8192) over 131072 packed
    /// tokens, bf16: its f32 workspace holds N·D + … ≈ 1.1·10⁹ elements, past 2³⁰ half
    /// elements; it runs, and its `dHidden` rows have the bits of a call on those rows alone.
    #[test]
    #[serial]
    fn qwen72b_head_backward_runs() {
        use burn::tensor::Distribution::Uniform;
        type AD = burn::backend::Autodiff<B>;
        let Some(device) = device() else { return };
        let (n, d, v) = (131_072, 8192, 152_064);
        let weight = Tensor::<B, 2>::random([v, d], Uniform(-0.02, 0.02), (&device, DType::BF16));
        let hidden = Tensor::<B, 2>::random([n, d], Uniform(-1.0, 1.0), (&device, DType::BF16));
        let targets: Vec<i64> = (0..n as i64).map(|i| i * 7919 % v as i64).collect();
        let d_hidden = |hidden: Tensor<B, 2>, targets: Vec<i64>| {
            let hidden = Tensor::<AD, 2>::from_inner(hidden).require_grad();
            let weight = Tensor::<AD, 2>::from_inner(weight.clone()).require_grad();
            let rows = targets.len();
            let targets = Tensor::<AD, 1, burn::tensor::Int>::from_data(
                burn::tensor::TensorData::new(targets, [rows]),
                &device,
            );
            let logp = burn_invariant::linear_logp(
                hidden.clone(),
                weight,
                targets,
                None,
                &LinearLogpOptions::default(),
            )
            .unwrap();
            let grads = logp.sum().backward();
            hidden.grad(&grads).unwrap()
        };
        let all = d_hidden(hidden.clone(), targets.clone());
        let tail = n - 3..n;
        let alone = d_hidden(
            hidden.slice([tail.clone(), 0..d]),
            targets[tail.clone()].to_vec(),
        );
        let got = super::bits(all.slice([tail, 0..d]));
        assert!(got.iter().all(|&b| f64::from_bits(b).is_finite()));
        super::assert_bits_eq("dHidden of the last rows", &got, &super::bits(alone));
    }

    /// A column slice of a wide tensor whose strides address past 2³¹ elements (its own elements
    /// fit): the CubeCl kernels take a copy, with the bits of the contiguous tensor.
    #[test]
    #[serial]
    fn views_past_32_bit_offsets() {
        let Some(device) = device() else { return };
        let (n, d) = (700_000, 1024);
        let wide = Tensor::<B, 2>::random(
            [n, 3 * d],
            burn::tensor::Distribution::Uniform(-1.0, 1.0),
            (&device, DType::BF16),
        );
        let view = wide.slice([0..n, d..2 * d]);
        let dense = Tensor::<B, 2>::from_data(view.clone().into_data(), (&device, DType::BF16));
        let weight = Tensor::<B, 2>::random(
            [512, d],
            burn::tensor::Distribution::Uniform(-0.05, 0.05),
            (&device, DType::BF16),
        );
        let targets = Tensor::<B, 1, burn::tensor::Int>::from_data(
            burn::tensor::TensorData::new((0..n as i64).map(|i| i % 512).collect::<Vec<_>>(), [n]),
            &device,
        );
        let opts = LinearLogpOptions::default();
        let logp = |h| {
            burn_invariant::linear_logp(h, weight.clone(), targets.clone(), None, &opts).unwrap()
        };
        super::assert_bits_eq(
            "linear_logp of a wide view",
            &super::bits(logp(view.clone())),
            &super::bits(logp(dense.clone())),
        );
        let mm = |h| burn_invariant::matmul(h, weight.clone().transpose()).unwrap();
        let (a, b) = (mm(view), mm(dense));
        super::assert_bits_eq(
            "matmul of a wide view",
            &super::bits(a.slice([n - 8..n, 0..512])),
            &super::bits(b.slice([n - 8..n, 0..512])),
        );
    }
}
