//! The whole generic suite on the NdArray reference.
#[macro_use]
mod common;

type B = burn::backend::NdArray<f32>;
type AD = burn::backend::Autodiff<B>;

invariant_testsuite!(B, AD, Some(Default::default()), dtypes: [burn::tensor::DType::F32], other_dtype: burn::tensor::DType::F64);

mod f64_backend {
    //! NdArray<f64>: f64 tensors are computed in f32 arithmetic and converted back.
    use super::common;
    type B = burn::backend::NdArray<f64>;
    type AD = burn::backend::Autodiff<B>;
    invariant_testsuite!(B, AD, Some(Default::default()), dtypes: [burn::tensor::DType::F64], other_dtype: burn::tensor::DType::F32);
}

/// The sampler's draws against the exact softmax (chi-square), on the Reference: the kernels
/// draw the same noise and are checked against it bitwise in f32 (`tests/gpu.rs`).
#[test]
fn linear_sample_distribution() {
    common::sampler::sample_distribution::<B>(&Default::default());
}
