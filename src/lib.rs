#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod autodiff;
pub mod backend;
#[cfg(feature = "cubecl")]
mod cube;
mod error;
pub mod nn;
mod ops;
pub mod reference;
pub mod registry;
pub mod tp;
mod validate;

pub use backend::InvariantBackend;
pub use error::InvariantError;
pub use ops::{LinearLogpOptions, linear, linear_logp, linear_logp_with_lse, matmul};
pub use validate::INDEX_LIMIT;
