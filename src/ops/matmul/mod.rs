//! `matmul` and `linear`: deterministic, batch-invariant GEMM with an optional bias
//! (docs/CONTRACT.md, *Invariance*).
pub(crate) mod api;
mod autodiff;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "cubecl")]
mod fusion;
pub mod oracle;
mod reference;

use burn::tensor::{backend::Backend, ops::FloatTensor};

use crate::registry::Implementation;

pub use api::{linear, matmul};

/// The GEMM primitives of a backend. They receive validated inputs and the implementation the
/// registry chose, and never fail.
pub trait MatmulOps: Backend {
    /// `lhs [M, K] · rhs [K, N] (+ bias [N])`, in the input dtype. Row-invariant.
    fn invariant_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        implementation: Implementation,
    ) -> FloatTensor<Self>;

    /// `grad [M, N] · rhsᵀ` with `rhs [K, N]` → `[M, K]` (the lhs gradient). Row-invariant.
    fn invariant_matmul_grad_lhs(
        grad: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self>;

    /// `lhsᵀ · grad` with `lhs [M, K]`, `grad [M, N]` → `[K, N]` (the rhs gradient): rows
    /// reduced in ascending order, in fixed-size blocks that do not depend on M.
    fn invariant_matmul_grad_rhs(
        lhs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self>;

    /// Column sums of `grad [M, N]` → `[N]` (the bias gradient), rows in ascending order,
    /// accumulated in f32.
    fn invariant_sum_rows(
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self>;
}
