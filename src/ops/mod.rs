//! One room per op: each op's primitives trait, its types, its public function and its
//! implementations (`reference`, `cube`, `fusion`, `autodiff`) in one folder.
pub mod attention;
pub mod linear_logp;
pub mod linear_sample;
pub(crate) mod math;
pub mod matmul;
pub mod rms_norm;
