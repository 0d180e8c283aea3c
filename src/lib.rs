#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub mod backend;
mod backends;
mod error;
mod fingerprint;
mod fnv;
pub mod nn;
pub mod ops;
pub mod registry;
pub mod tp;
mod validate;

pub use backend::InvariantBackend;
pub use error::InvariantError;
pub use fingerprint::{Fingerprint, fingerprint};
pub use ops::attention::{AttentionOptions, attention, attention_with_lens};
pub use ops::linear_logp::{
    LinearLogpOptions, LinearLogpOutput, linear_logp, linear_logp_full, linear_logp_with_lse,
};
pub use ops::linear_sample::{LinearSampleOutput, SampleOptions, TOP_K_MAX, linear_sample};
pub use ops::matmul::{linear, matmul};
pub use ops::rms_norm::rms_norm;
pub use validate::INDEX_LIMIT;

/// The Reference arithmetic of `matmul` and `linear_logp` on host slices: what the Reference
/// backend runs and the kernels are tested against (attention's and RMSNorm's are in their
/// rooms, [`ops::attention::oracle`] and [`ops::rms_norm::oracle`]).
pub mod oracle {
    pub use crate::ops::linear_logp::oracle::*;
    pub use crate::ops::matmul::oracle::*;
}
