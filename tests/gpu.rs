//! The generic suite on the CubeCL backends: wgpu (lavapipe in CI) and CUDA (an H100 on the
//! device machine), each raw and under Fusion. Without a device a test prints a notice and
//! passes, unless `BURN_INVARIANT_REQUIRE_WGPU=1` / `BURN_INVARIANT_REQUIRE_CUDA=1` makes the
//! missing device a failure (CI sets the first, the GPU run the second).
#![cfg(any(feature = "wgpu", feature = "cuda"))]

#[macro_use]
mod common;

use std::sync::OnceLock;

/// Probes a device once; `None` (with a notice) when it is absent and not required.
fn probe<D: Clone + Send + Sync + 'static>(
    cell: &'static OnceLock<Option<D>>,
    what: &str,
    require_env: &str,
    init: impl FnOnce() -> Option<D> + std::panic::UnwindSafe,
) -> Option<D> {
    cell.get_or_init(|| {
        let found = std::panic::catch_unwind(init).ok().flatten();
        if found.is_none() {
            if std::env::var(require_env).is_ok_and(|v| v == "1") {
                panic!("{what}: no device, and {require_env}=1 requires one");
            }
            eprintln!(
                "NOTICE: {what}: no device found, skipping (set {require_env}=1 to fail instead)"
            );
        }
        found
    })
    .clone()
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    use burn_wgpu::{WgpuDevice, WgpuRuntime};

    pub fn device() -> Option<WgpuDevice> {
        static CELL: OnceLock<Option<WgpuDevice>> = OnceLock::new();
        probe(&CELL, "wgpu", "BURN_INVARIANT_REQUIRE_WGPU", || {
            let device = WgpuDevice::DefaultDevice;
            // Creating the client panics when no adapter exists.
            let _ = <WgpuRuntime as cubecl::Runtime>::client(&device);
            Some(device)
        })
    }

    mod raw {
        use super::super::common;
        type B = burn_cubecl::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u32>;
        type AD = burn::backend::Autodiff<B>;
        invariant_testsuite!(B, AD, super::device(), dtypes: [burn::tensor::DType::F32, burn::tensor::DType::F16], other_dtype: burn::tensor::DType::F16);
    }

    mod fusion {
        use super::super::common;
        type B =
            burn_fusion::Fusion<burn_cubecl::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u32>>;
        type AD = burn::backend::Autodiff<B>;
        invariant_testsuite!(B, AD, super::device(), dtypes: [burn::tensor::DType::F32, burn::tensor::DType::F16], other_dtype: burn::tensor::DType::F16);
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use burn_cuda::CudaDevice;

    pub fn device() -> Option<CudaDevice> {
        static CELL: OnceLock<Option<CudaDevice>> = OnceLock::new();
        probe(&CELL, "cuda", "BURN_INVARIANT_REQUIRE_CUDA", || {
            // cudarc loads libcuda lazily and panics when it is absent.
            cudarc::driver::result::init().ok()?;
            let count = cudarc::driver::result::device::get_count().ok()?;
            (count > 0).then(|| CudaDevice::new(0))
        })
    }

    mod raw {
        use super::super::common;
        type B = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
        type AD = burn::backend::Autodiff<B>;
        invariant_testsuite!(B, AD, super::device(), dtypes: [burn::tensor::DType::F32, burn::tensor::DType::F16, burn::tensor::DType::BF16], other_dtype: burn::tensor::DType::BF16);
    }

    mod fusion {
        use super::super::common;
        type B =
            burn_fusion::Fusion<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>>;
        type AD = burn::backend::Autodiff<B>;
        invariant_testsuite!(B, AD, super::device(), dtypes: [burn::tensor::DType::F32, burn::tensor::DType::BF16], other_dtype: burn::tensor::DType::F16);
    }
}
