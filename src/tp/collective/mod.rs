//! The [`Collective`] implementations: threads of one process, and NCCL (feature `cuda`).
mod in_process;
#[cfg(feature = "cuda")]
mod nccl;

pub use crate::backend::Collective;

/// The longest wait a group keeps: longer timeouts (`Duration::MAX` included) wait this long.
pub const LONGEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);
pub use in_process::{DEFAULT_TIMEOUT, InProcessGroup};
#[cfg(feature = "cuda")]
pub use nccl::{NCCL_DEFAULT_TIMEOUT, NcclGroup, NcclId};
