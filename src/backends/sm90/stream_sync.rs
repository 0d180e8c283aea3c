//! `kernels/stream_sync.cu` on cubecl's stream: the flag-word kernels that order the NCCL
//! group's stream with cubecl's (cubecl 0.10 keeps its `CUstream` private).
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::Binding;

use super::nvrtc::launch;
pub(crate) use super::params::SyncParams;
use super::table::entry;

/// One entry point of `kernels/stream_sync.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SyncKernel {
    /// Publishes the sequence number once the block (an ordered buffer) is written.
    Signal,
    /// One warp holds later work until the NCCL stream publishes the number back.
    Wait,
    /// Moves the gathered words into the result (NaN where the wait timed out).
    Copy,
}

/// Words one `ib_copy` block moves (its threads in `kernels/entries.txt`).
pub(crate) const COPY_WORDS_PER_BLOCK: usize = entry!("ib_copy").threads as usize;

/// Launches `kernel` on `grid` blocks on the client's stream; the block size is the table's
/// (`kernels/entries.txt`).
pub(crate) fn launch_stream_sync(
    client: &ComputeClient<CudaRuntime>,
    kernel: SyncKernel,
    grid: u32,
    buffers: Vec<Binding>,
    params: SyncParams,
) {
    let kernel = match kernel {
        SyncKernel::Signal => entry!("ib_signal"),
        SyncKernel::Wait => entry!("ib_wait"),
        SyncKernel::Copy => entry!("ib_copy"),
    };
    launch(client, kernel, grid as usize, vec![], buffers, &params);
}
