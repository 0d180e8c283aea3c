//! `rms_norm`: root-mean-square normalization with a fixed per-row reduction order
//! (docs/CONTRACT.md, *rms_norm semantics*).
mod api;
mod autodiff;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "cubecl")]
mod fusion;
pub mod oracle;
mod reference;

use burn::tensor::{backend::Backend, ops::FloatTensor};

use crate::registry::Implementation;

pub use api::rms_norm;

/// Inputs of the RMSNorm primitives, validated.
#[derive(Debug, Clone)]
pub struct RmsNormInputs<B: Backend> {
    /// `[N, D]`.
    pub x: FloatTensor<B>,
    /// `[D]`, `x`'s dtype.
    pub gamma: FloatTensor<B>,
    /// Added to the mean square, as f32.
    pub eps: f32,
}

/// Gradients of RMSNorm, each in its input's dtype and shape.
#[derive(Debug, Clone)]
pub struct RmsNormGrads<B: Backend> {
    /// `dX [N, D]`.
    pub x: FloatTensor<B>,
    /// `dGamma [D]`.
    pub gamma: FloatTensor<B>,
}

/// The RMSNorm primitives of a backend. They receive validated inputs and the implementation
/// the registry chose, and never fail.
pub trait RmsNormOps: Backend {
    /// `y [N, D]` (docs/CONTRACT.md, *rms_norm semantics*).
    fn invariant_rms_norm(
        inputs: RmsNormInputs<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self>;

    /// `(dX, dGamma)` from the upstream `grad [N, D]`.
    fn invariant_rms_norm_backward(
        inputs: RmsNormInputs<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> RmsNormGrads<Self>;
}
