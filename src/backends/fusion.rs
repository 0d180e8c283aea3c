//! `InvariantBackend` for `burn_fusion::Fusion<B>` (what `burn::backend::{Wgpu, Cuda}` are with
//! their default `fusion` feature): the inner backend's candidates and limits. Each op's
//! primitives are opaque custom ops (`super::custom_op`) in the op's `fusion.rs`.
use burn::tensor::DType;
use burn_fusion::{Fusion, FusionBackend};

use crate::InvariantError;
use crate::backend::{InvariantBackend, Problem};
use crate::registry::{Candidate, Implementation, Op};

impl<B: FusionBackend + InvariantBackend> InvariantBackend for Fusion<B> {
    fn implementations(op: Op, device: &Self::Device, dtype: DType) -> Vec<Candidate> {
        B::implementations(op, device, dtype)
    }

    fn check_problem(
        implementation: Implementation,
        device: &Self::Device,
        dtype: DType,
        problem: Problem,
    ) -> Result<(), InvariantError> {
        B::check_problem(implementation, device, dtype, problem)
    }

    fn invariant_device_failure(device: &Self::Device) -> Option<InvariantError> {
        B::invariant_device_failure(device)
    }

    fn invariant_kernel_choices(device: &Self::Device, dtype: DType) -> String {
        B::invariant_kernel_choices(device, dtype)
    }
}
