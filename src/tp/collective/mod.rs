//! The [`Collective`] implementations: threads of one process, and NCCL (feature `cuda`).
mod in_process;
#[cfg(feature = "cuda")]
mod nccl;

pub use crate::backend::Collective;
pub use in_process::{DEFAULT_TIMEOUT, InProcessGroup};
#[cfg(feature = "cuda")]
pub use nccl::{NCCL_DEFAULT_TIMEOUT, NcclGroup, NcclId};
