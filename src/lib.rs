#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod api;
pub mod backend;
mod backends;
mod error;
pub mod nn;
pub mod ops;
pub mod registry;
pub mod tp;
mod validate;

pub use api::{
    LinearLogpOptions, LinearLogpOutput, linear, linear_logp, linear_logp_full,
    linear_logp_with_lse, matmul,
};
pub use backend::InvariantBackend;
pub use backends::ndarray::oracle;
pub use error::InvariantError;
pub use ops::attention::{AttentionOptions, attention};
pub use ops::rms_norm::rms_norm;
pub use validate::INDEX_LIMIT;
