//! The NCCL [`Collective`] for the CUDA backends: one communicator per GPU, through cudarc's
//! NCCL bindings (the same `libnccl` cubecl-cuda loads).
//!
//! # Ordering with Burn's compute
//! cubecl-cuda 0.10 keeps its `CUstream` private, so NCCL cannot be enqueued on it. The tensor
//! exchange ([`Collective::all_gather`]) is ordered through flag words in device memory instead,
//! with no host synchronisation (`kernels/stream_sync.cu`):
//! 1. on the cubecl stream, `ib_signal` publishes the exchange's sequence number once the block
//!    is written;
//! 2. the group's NCCL stream waits for it (`cuStreamWaitValue32`), runs `ncclAllGather` from
//!    the block into a receive buffer the group owns, and publishes the number back
//!    (`cuStreamWriteValue32`);
//! 3. on the cubecl stream, `ib_wait` (one warp) holds later work until then, and `ib_copy`
//!    moves the gathered blocks into a fresh tensor.
//!
//! The host only enqueues, so the next leaves are launched while the exchange runs. The group
//! keeps its receive buffer (as large as its largest exchange: `world · N · D · 4` bytes for the
//! backward) until it is dropped. The host
//! exchange ([`Collective::all_gather_host`], used by the validation) is synchronous: it
//! copies through the group's stream and polls it.
//!
//! # Failure
//! A peer that does not arrive within the timeout makes a host exchange abort the
//! communicator and return [`InvariantError::Collective`]; the group is broken for good after
//! that (every later call returns the same error). [`Collective::all_gather`] itself cannot
//! return a peer's failure (it has finished enqueueing before the peers arrive): when the
//! device-side wait times out, `ib_copy` fills the result with NaN, never stale data, and
//! `ib_wait` records the timeout. [`Collective::settle`], which every `tp` call runs before it
//! returns (unless the group defers failures, `with_deferred_failures`), reports it: it flushes
//! the exchange's cubecl client (cubecl may hold a thread's launches until then), then polls
//! the flag words from the host (16 bytes, back to back for 20 ms, then every 100 µs) until
//! the last exchange's device-side wait has resolved, and returns its error, so the failed call
//! itself fails, on every rank. The host gives up by itself (and breaks the group) only at twice
//! the timeout after this rank's compute reached the exchange, so the device-side timeout always
//! speaks first.
//!
//! The cost: a `tp` call returns only once this rank's compute up to its last exchange and
//! the exchange itself are done (the host waits for that); with deferred failures it returns
//! once its work is enqueued, and the failure is reported by the next call or `settle`. Work
//! enqueued after the exchange (the combine) still runs asynchronously, and no device
//! synchronisation happens. [`Collective::fail`] breaks the group from outside (a failed
//! backward); `ncclCommInitRank` is run on a watchdog thread, so a rank that never joins
//! fails [`NcclGroup::new`] in bounded time too.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Tensor};
use burn_cubecl::kernel::into_contiguous;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DriverError, PinnedHostSlice, sys as driver_sys,
};
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use crate::InvariantError;
use crate::backend::Collective;
use crate::backends::cuda::{CudaBackend, CudaOps, CudaTensor};
use crate::backends::sm90::stream_sync::{
    COPY_WORDS_PER_BLOCK, SyncKernel, SyncParams, launch_stream_sync,
};

/// How long [`NcclGroup`] waits for the other ranks, by default.
pub const NCCL_DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// Words per rank of a host exchange's first (fixed-size) all-gather: the length, then the
/// block's first words; the validation table fits in one.
const HOST_ENVELOPE: usize = 128;
/// How long `settle` polls an exchange's flags back to back before it backs off.
const SETTLE_SPIN: Duration = Duration::from_millis(20);

/// An NCCL unique id: made once (by rank 0, or by the process that spawns the rank threads)
/// and handed to every rank. [`NcclId::to_hex`] / [`NcclId::from_hex`] carry it through a file
/// or an environment variable to other processes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; 128]);

impl core::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "NcclId({}…)", &self.to_hex()[..16])
    }
}

impl NcclId {
    /// A fresh id (`ncclGetUniqueId`; loads `libnccl`).
    pub fn new() -> Result<Self, InvariantError> {
        let id = nccl::get_uniqueid().map_err(|e| collective(format!("ncclGetUniqueId: {e:?}")))?;
        Ok(Self(id.internal.map(|c| c as u8)))
    }

    /// The 128 bytes as 256 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`NcclId::to_hex`]'s output.
    pub fn from_hex(hex: &str) -> Result<Self, InvariantError> {
        let hex = hex.trim();
        let bad = || InvariantError::Collective {
            reason: format!(
                "an NCCL id must be 256 hex digits, got {} characters",
                hex.len()
            ),
        };
        if hex.len() != 256 || !hex.is_ascii() {
            return Err(bad());
        }
        let mut bytes = [0u8; 128];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(bytes))
    }

    fn raw(&self) -> nccl_sys::ncclUniqueId {
        nccl_sys::ncclUniqueId {
            internal: self.0.map(|b| b as core::ffi::c_char),
        }
    }
}

/// One rank's handle of an NCCL group; `Clone` gives another handle to the same communicator.
///
/// ```ignore
/// // One process, one thread per GPU:
/// let groups = NcclGroup::for_devices(&devices)?;        // or NcclGroup::new per thread
/// // Several processes: rank 0 writes NcclId::new()?.to_hex() where the others read it, then
/// let group = NcclGroup::new(&CudaDevice::new(local), rank, world, &id)?;
/// ```
#[derive(Clone)]
pub struct NcclGroup {
    shared: Arc<Shared>,
}

struct Shared {
    rank: usize,
    world: usize,
    device: CudaDevice,
    timeout: Duration,
    stream: Arc<CudaStream>,
    /// `None` once aborted; every later call returns `broken`.
    comm: Mutex<Option<RawComm>>,
    broken: Mutex<Option<InvariantError>>,
    /// The stream-ordering state, made at the first tensor exchange on the caller's client.
    ordered: Mutex<Option<Ordered>>,
    /// The host exchange's buffers, made at its first call and kept: no allocation per call.
    envelopes: Mutex<Option<Envelopes>>,
    /// `tp` calls return without waiting for their exchange (`with_deferred_failures`).
    deferred: AtomicBool,
}

/// Device and page-locked host buffers of one host exchange: one envelope out, `world` in.
struct Envelopes {
    send: CudaSlice<u64>,
    recv: CudaSlice<u64>,
    host_send: PinnedHostSlice<u64>,
    host_recv: PinnedHostSlice<u64>,
}

impl Envelopes {
    /// Room for blocks of up to `words` words.
    fn new(stream: &Arc<CudaStream>, world: usize, words: usize) -> Result<Self, DriverError> {
        let context = stream.context();
        // SAFETY: a block is written to `host_send` before it is sent, and `host_recv` is read
        // only after the gathered blocks were copied into it.
        let (host_send, host_recv) = unsafe {
            (
                context.alloc_pinned_with_flags::<u64>(words, 0)?,
                context.alloc_pinned_with_flags::<u64>(words * world, 0)?,
            )
        };
        Ok(Self {
            send: stream.alloc_zeros::<u64>(words)?,
            recv: stream.alloc_zeros::<u64>(words * world)?,
            host_send,
            host_recv,
        })
    }
}

impl Drop for Shared {
    /// Tensor exchanges may still be in flight when the last handle goes: let them finish
    /// (bounded by the timeout) before the communicator is aborted.
    fn drop(&mut self) {
        if self.stream.context().bind_to_thread().is_err() {
            return;
        }
        let deadline = Instant::now() + self.timeout;
        // SAFETY: a valid stream of the bound context.
        while unsafe { driver_sys::cuStreamQuery(self.stream.cu_stream()) }
            == driver_sys::CUresult::CUDA_ERROR_NOT_READY
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Flag words and the receive buffer of the stream-ordered exchange (`kernels/stream_sync.cu`).
struct Ordered {
    /// `[compute progress, NCCL progress, timed-out sequence number, resolved wait]`, u32 each, in
    /// `cuMemAlloc` memory (stream memory operations reject cubecl's pool memory). Never
    /// freed: kernels on a cubecl stream may still read it after the group is gone.
    flags_ptr: u64,
    /// The receive buffer, its address and its size in bytes.
    recv: Option<(Handle, u64, usize)>,
    seq: u32,
    /// The client of the last exchange: `settle` flushes it, as cubecl may hold its launches
    /// (the `ib_wait` that resolves the exchange among them) until then.
    client: Option<ComputeClient<CudaRuntime>>,
}

impl Ordered {
    /// Needs the group's context bound on this thread.
    fn new() -> Result<Self, InvariantError> {
        use cudarc::driver::result::{malloc_sync, memset_d8_sync};
        let flags_err = |e| collective(format!("allocating the exchange flags: {e:?}"));
        // SAFETY: a fresh 16-byte allocation, zeroed before any use.
        let flags_ptr = unsafe {
            let ptr = malloc_sync(16).map_err(flags_err)?;
            memset_d8_sync(ptr, 0, 16).map_err(flags_err)?;
            ptr
        };
        Ok(Self {
            flags_ptr,
            recv: None,
            seq: 0,
            client: None,
        })
    }

    /// The next sequence number (never 0, the flags' initial value).
    fn next(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1).max(1);
        self.seq
    }

    /// A receive buffer of at least `bytes`. A replaced one is only reused by cubecl after
    /// the `ib_wait` already enqueued behind its last exchange.
    fn recv(
        &mut self,
        client: &ComputeClient<CudaRuntime>,
        bytes: usize,
    ) -> Result<(Handle, u64), InvariantError> {
        match &self.recv {
            Some((handle, ptr, size)) if *size >= bytes => Ok((handle.clone(), *ptr)),
            _ => {
                let handle = client.empty(bytes);
                let ptr = address(client, &handle)?;
                self.recv = Some((handle.clone(), ptr, bytes));
                Ok((handle, ptr))
            }
        }
    }
}

/// The device address of a cubecl buffer (stable while its handle lives).
fn address(client: &ComputeClient<CudaRuntime>, handle: &Handle) -> Result<u64, InvariantError> {
    client
        .get_resource(handle.clone())
        .map(|resource| resource.resource().ptr)
        .map_err(|e| collective(format!("cubecl buffer: {e:?}")))
}

/// An owned `ncclComm_t`, used by one thread at a time (behind the group's mutex).
struct RawComm(nccl_sys::ncclComm_t);

// SAFETY: NCCL communicators may be used from any thread as long as calls on one communicator
// do not overlap; the group's mutex serialises them.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: the communicator is owned and no call on it is in flight (we hold it).
        // `ncclCommAbort` never waits for peers, so dropping a broken group cannot hang.
        unsafe {
            let _ = nccl::comm_abort(self.0);
        }
    }
}

impl core::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.shared.rank)
            .field("world", &self.shared.world)
            .field("device", &self.shared.device)
            .field("timeout", &self.shared.timeout)
            .finish()
    }
}

fn collective(reason: String) -> InvariantError {
    InvariantError::Collective { reason }
}

fn context(device: &CudaDevice) -> Result<Arc<CudaContext>, InvariantError> {
    let ctx = CudaContext::new(device.index)
        .map_err(|e| collective(format!("CUDA context of device {}: {e:?}", device.index)))?;
    ctx.bind_to_thread()
        .map_err(|e| collective(format!("binding the CUDA context: {e:?}")))?;
    Ok(ctx)
}

impl NcclGroup {
    /// Joins rank `rank` of a `world`-rank group on `device` (`ncclCommInitRank`). Every rank
    /// calls this with the same `id`, concurrently (it returns once all have joined, or fails
    /// after [`NCCL_DEFAULT_TIMEOUT`]).
    pub fn new(
        device: &CudaDevice,
        rank: usize,
        world: usize,
        id: &NcclId,
    ) -> Result<Self, InvariantError> {
        Self::with_timeout(device, rank, world, id, NCCL_DEFAULT_TIMEOUT)
    }

    /// [`NcclGroup::new`] with another timeout for joining and for every exchange.
    pub fn with_timeout(
        device: &CudaDevice,
        rank: usize,
        world: usize,
        id: &NcclId,
        timeout: Duration,
    ) -> Result<Self, InvariantError> {
        if world == 0 || rank >= world || world > i32::MAX as usize {
            return Err(collective(format!(
                "NCCL group: rank must be in 0..world with world ≥ 1, got rank {rank} of world {world}"
            )));
        }
        let stream = context(device)?
            .new_stream()
            .map_err(|e| collective(format!("CUDA stream on device {}: {e:?}", device.index)))?;
        let (sender, receiver) = mpsc::channel();
        let (raw_id, index) = (id.raw(), device.index);
        // The watchdog: a rank that never joins leaves this thread blocked inside NCCL, but
        // the caller gets an error after `timeout`.
        std::thread::spawn(move || {
            let joined = CudaContext::new(index)
                .and_then(|ctx| ctx.bind_to_thread())
                .map_err(|e| format!("binding the CUDA context: {e:?}"))
                .and_then(|()| {
                    let mut comm = core::mem::MaybeUninit::uninit();
                    // SAFETY: `comm` is written by NCCL on success.
                    unsafe {
                        nccl::comm_init_rank(comm.as_mut_ptr(), world as i32, raw_id, rank as i32)
                            .map(|_| RawComm(comm.assume_init()))
                            .map_err(|e| format!("ncclCommInitRank: {e:?}"))
                    }
                });
            // The receiver may have given up; the communicator is then aborted on drop.
            let _ = sender.send(joined);
        });
        let comm = match receiver.recv_timeout(timeout) {
            Ok(joined) => joined.map_err(collective)?,
            Err(_) => {
                return Err(collective(format!(
                    "rank {rank} of {world}: not every rank joined the NCCL group within {timeout:?}"
                )));
            }
        };
        let group = Self::from_parts(rank, world, device.clone(), timeout, stream, comm);
        // NCCL connects peers lazily on the first collective, blocking there if one is missing;
        // connect now, inside the bounded wait.
        Collective::<CudaOps>::all_gather_host(&group, &[0])?;
        Ok(group)
    }

    /// One handle per device (rank = index in `devices`) of an in-process group, for one
    /// thread per GPU (`ncclCommInitAll`; no id needed).
    pub fn for_devices(devices: &[CudaDevice]) -> Result<Vec<Self>, InvariantError> {
        Self::for_devices_with_timeout(devices, NCCL_DEFAULT_TIMEOUT)
    }

    /// [`NcclGroup::for_devices`] with another exchange timeout.
    pub fn for_devices_with_timeout(
        devices: &[CudaDevice],
        timeout: Duration,
    ) -> Result<Vec<Self>, InvariantError> {
        let world = devices.len();
        let mut ordinals: Vec<i32> = devices.iter().map(|d| d.index as i32).collect();
        ordinals.sort_unstable();
        if world == 0 || ordinals.windows(2).any(|w| w[0] == w[1]) {
            return Err(collective(format!(
                "NCCL group: expected distinct CUDA devices, one per rank, got {:?}",
                devices.iter().map(|d| d.index).collect::<Vec<_>>()
            )));
        }
        let streams = devices
            .iter()
            .map(|device| {
                context(device)?.new_stream().map_err(|e| {
                    collective(format!("CUDA stream on device {}: {e:?}", device.index))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let ordinals: Vec<i32> = devices.iter().map(|d| d.index as i32).collect();
        let mut comms = vec![core::ptr::null_mut(); world];
        // SAFETY: `comms` has `world` slots; NCCL fills them on success.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), world as i32, ordinals.as_ptr()) }
            .map_err(|e| collective(format!("ncclCommInitAll: {e:?}")))?;
        Ok(comms
            .into_iter()
            .zip(streams)
            .zip(devices)
            .enumerate()
            .map(|(rank, ((comm, stream), device))| {
                Self::from_parts(rank, world, device.clone(), timeout, stream, RawComm(comm))
            })
            .collect())
    }

    fn from_parts(
        rank: usize,
        world: usize,
        device: CudaDevice,
        timeout: Duration,
        stream: Arc<CudaStream>,
        comm: RawComm,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                rank,
                world,
                device,
                timeout: timeout.min(super::LONGEST_TIMEOUT),
                stream,
                comm: Mutex::new(Some(comm)),
                broken: Mutex::new(None),
                ordered: Mutex::new(None),
                envelopes: Mutex::new(None),
                deferred: AtomicBool::new(false),
            }),
        }
    }

    /// With `deferred`, a `tp` call returns once its work is enqueued, without waiting on the
    /// host for its tensor exchange: a failed exchange (a peer missing past the timeout) still
    /// gives NaN, never stale data, and is reported by this group's next call, or by
    /// [`Collective::settle`] (call it once per training step, before the optimizer). The default
    /// (`false`) fails the call that made the exchange, at the cost of a host wait per call.
    /// Applies to every clone of the group.
    pub fn with_deferred_failures(self, deferred: bool) -> Self {
        self.shared.deferred.store(deferred, Ordering::Relaxed);
        self
    }

    /// The GPU of this rank.
    pub fn device(&self) -> &CudaDevice {
        &self.shared.device
    }

    /// Enqueues the stream-ordered all-gather of `send` (`len` f32) into `out` (module docs).
    fn enqueue_all_gather(
        &self,
        client: &ComputeClient<CudaRuntime>,
        send: &CudaTensor,
        out: &CudaTensor,
        len: usize,
    ) -> Result<(), InvariantError> {
        let shared = &self.shared;
        let (mut comm, raw) = self.live_comm()?;
        let mut ordered = Self::lock(&shared.ordered);
        let state = match &mut *ordered {
            Some(state) => state,
            empty => empty.insert(Ordered::new()?),
        };
        let words = len * shared.world;
        let seq = state.next();
        state.client = Some(client.clone());
        let (recv, recv_ptr) = state.recv(client, words * 4)?;
        let flags_ptr = state.flags_ptr;
        let timeout_ns = shared.timeout.as_nanos().min(u64::MAX as u128) as u64;
        let sync_params = |words: usize| SyncParams {
            flags: flags_ptr,
            seq,
            pad: 0,
            timeout_ns,
            words: words as u64,
        };
        let order = vec![send.handle.clone().binding(), recv.clone().binding()];
        launch_stream_sync(client, SyncKernel::Signal, 1, order, sync_params(0));
        // The block's memory may be reused once its handle drops, but only by work enqueued
        // on this cubecl stream, which is behind the `ib_wait` below.
        let send_ptr = address(client, &send.handle)?;
        let enqueued = self.enqueue_nccl_side(raw, [send_ptr, recv_ptr, flags_ptr], len, seq);
        let failure = enqueued.err().map(|reason| {
            // Release this exchange's device-side wait with its result marked for NaN.
            let marks = [seq, seq];
            // SAFETY: writes 8 bytes into the live flag words 1 and 2.
            unsafe {
                driver_sys::cuMemcpyHtoD_v2(flags_ptr + 4, marks.as_ptr().cast(), 8);
            }
            format!("rank {}: enqueueing the all-gather: {reason}", shared.rank)
        });
        launch_stream_sync(client, SyncKernel::Wait, 1, vec![], sync_params(0));
        let blocks = words.div_ceil(COPY_WORDS_PER_BLOCK).min(1 << 16) as u32;
        launch_stream_sync(
            client,
            SyncKernel::Copy,
            blocks,
            vec![recv.binding(), out.handle.clone().binding()],
            sync_params(words),
        );
        match failure {
            Some(reason) => Err(self.break_group(&mut comm, collective(reason))),
            None => Ok(()),
        }
    }

    /// The NCCL stream's part of an exchange: wait for the block, all-gather it, publish the
    /// sequence number back.
    fn enqueue_nccl_side(
        &self,
        comm: nccl_sys::ncclComm_t,
        [send_ptr, recv_ptr, flags_ptr]: [u64; 3],
        len: usize,
        seq: u32,
    ) -> Result<(), String> {
        let nccl_stream = self.shared.stream.cu_stream();
        // SAFETY: the flag words and both buffers are live device memory of this context
        // (the group owns `recv` and `flags`; `send` is alive until the exchange is waited
        // for, see `enqueue_all_gather`); the stream belongs to this communicator's device.
        unsafe {
            let waited = driver_sys::cuStreamWaitValue32_v2(
                nccl_stream,
                flags_ptr,
                seq,
                driver_sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            );
            if waited != driver_sys::CUresult::CUDA_SUCCESS {
                return Err(format!("cuStreamWaitValue32: {waited:?}"));
            }
            nccl::all_gather(
                send_ptr as *const _,
                recv_ptr as *mut _,
                len,
                nccl_sys::ncclDataType_t::ncclFloat32,
                comm,
                nccl_stream as _,
            )
            .map_err(|e| format!("ncclAllGather: {e:?}"))?;
            match driver_sys::cuStreamWriteValue32_v2(
                nccl_stream,
                flags_ptr + 4,
                seq,
                driver_sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            ) {
                driver_sys::CUresult::CUDA_SUCCESS => Ok(()),
                other => Err(format!("cuStreamWriteValue32: {other:?}")),
            }
        }
    }

    /// Fails (and breaks the group) when a tensor exchange's device-side wait timed out.
    fn check_device_waits(&self) -> Result<(), InvariantError> {
        let shared = &self.shared;
        let Some(flags_ptr) = Self::lock(&shared.ordered).as_ref().map(|o| o.flags_ptr) else {
            return Ok(());
        };
        self.bind_context()?;
        let mut timed_out = 0u32;
        // SAFETY: reads 4 bytes of the group's live flag buffer into a local.
        let read = unsafe {
            driver_sys::cuMemcpyDtoH_v2((&mut timed_out as *mut u32).cast(), flags_ptr + 8, 4)
        };
        if read != driver_sys::CUresult::CUDA_SUCCESS {
            return Err(collective(format!(
                "rank {}: reading the exchange flags: {read:?}",
                shared.rank
            )));
        }
        if timed_out == 0 {
            return Ok(());
        }
        let error = collective(format!(
            "rank {} of {}: tensor exchange {timed_out} was not completed by every rank within \
             {:?}; its result was set to NaN",
            shared.rank, shared.world, shared.timeout
        ));
        Err(self.break_group(&mut Self::lock(&shared.comm), error))
    }

    /// Waits on the host until the device-side wait of the last enqueued tensor exchange has
    /// resolved (`flags[3]`, `kernels/stream_sync.cu`), bounded by the timeout, then reports
    /// whether any timed out. Polls 16 bytes with a growing pause: no device synchronisation,
    /// so kernels enqueued after the exchange keep running.
    fn settle_exchanges(&self) -> Result<(), InvariantError> {
        let shared = &self.shared;
        if let Some(error) = Self::lock(&shared.broken).clone() {
            return Err(error);
        }
        let Some((flags_ptr, seq, client)) = Self::lock(&shared.ordered)
            .as_ref()
            .map(|o| (o.flags_ptr, o.seq, o.client.clone()))
        else {
            return Ok(());
        };
        if seq == 0 {
            return Ok(());
        }
        if let Some(client) = client {
            client
                .flush()
                .map_err(|e| collective(format!("rank {}: flushing cubecl: {e:?}", shared.rank)))?;
        }
        self.bind_context()?;
        // The clock starts once this rank's compute has reached the exchange (`flags[0]`): the
        // device-side wait then times out first, and the host only backs it up, at twice the
        // timeout. The compute before the exchange is not bounded here.
        let mut deadline = None;
        let polling = Instant::now();
        loop {
            let mut flags = [0u32; 4];
            // SAFETY: reads the group's live 16-byte flag buffer into a local.
            let read =
                unsafe { driver_sys::cuMemcpyDtoH_v2(flags.as_mut_ptr().cast(), flags_ptr, 16) };
            if read != driver_sys::CUresult::CUDA_SUCCESS {
                return Err(collective(format!(
                    "rank {}: reading the exchange flags: {read:?}",
                    shared.rank
                )));
            }
            // Modulo 2^32, as the kernels compare.
            let resolved = flags[3].wrapping_sub(seq) as i32 >= 0 && flags[3] != 0;
            if resolved || flags[2] != 0 {
                return self.check_device_waits();
            }
            let reached = flags[0].wrapping_sub(seq) as i32 >= 0 && flags[0] != 0;
            if reached && deadline.is_none() {
                deadline = Some(Instant::now() + 2 * shared.timeout);
            }
            if deadline.is_some_and(|d| Instant::now() > d) {
                let error = collective(format!(
                    "rank {} of {}: tensor exchange {seq} was not completed within {:?} (a \
                     rank is missing or called a different collective)",
                    shared.rank, shared.world, shared.timeout
                ));
                return Err(self.break_group(&mut Self::lock(&shared.comm), error));
            }
            // A sleep would overshoot the exchange's end by up to its length, and the call
            // waits for that: yield while the exchange is likely close, back off after.
            if polling.elapsed() < SETTLE_SPIN {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// The communicator, locked for one call, with the group's context bound on this thread;
    /// the group's error once it is broken.
    fn live_comm(
        &self,
    ) -> Result<(MutexGuard<'_, Option<RawComm>>, nccl_sys::ncclComm_t), InvariantError> {
        let comm = Self::lock(&self.shared.comm);
        if let Some(error) = Self::lock(&self.shared.broken).clone() {
            return Err(error);
        }
        let Some(raw) = comm.as_ref().map(|c| c.0) else {
            return Err(collective("the NCCL communicator was aborted".into()));
        };
        self.bind_context()?;
        Ok((comm, raw))
    }

    fn bind_context(&self) -> Result<(), InvariantError> {
        self.shared
            .stream
            .context()
            .bind_to_thread()
            .map_err(|e| collective(format!("binding the CUDA context: {e:?}")))
    }

    fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
        mutex.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn break_group(&self, comm: &mut Option<RawComm>, error: InvariantError) -> InvariantError {
        // Aborting frees NCCL's kernels from waiting on peers that will not come.
        comm.take();
        *Self::lock(&self.shared.broken) = Some(error.clone());
        error
    }

    /// Runs one all-gather of `count` elements of `dtype` from `send` into `recv` on the
    /// group's stream, then whatever `after` enqueues behind it, and waits for the stream,
    /// bounded by the timeout.
    fn all_gather_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: nccl_sys::ncclDataType_t,
        after: impl FnOnce() -> Result<(), DriverError>,
    ) -> Result<(), InvariantError> {
        let shared = &self.shared;
        let (mut comm, raw) = self.live_comm()?;
        // SAFETY: `send`/`recv` are live device buffers of `count` and `world · count`
        // elements on this communicator's device; the caller keeps them alive until we return.
        let enqueued = unsafe {
            nccl::all_gather(
                send as *const _,
                recv as *mut _,
                count,
                dtype,
                raw,
                shared.stream.cu_stream() as _,
            )
        };
        if let Err(e) = enqueued {
            let error = collective(format!("rank {}: ncclAllGather: {e:?}", shared.rank));
            return Err(self.break_group(&mut comm, error));
        }
        if let Err(e) = after() {
            let error = collective(format!("rank {}: host copy: {e:?}", shared.rank));
            return Err(self.break_group(&mut comm, error));
        }
        let deadline = Instant::now() + shared.timeout;
        loop {
            // SAFETY: a valid stream of the bound context.
            match unsafe { driver_sys::cuStreamQuery(shared.stream.cu_stream()) } {
                driver_sys::CUresult::CUDA_SUCCESS => return Ok(()),
                driver_sys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => {
                    let error = collective(format!(
                        "rank {}: the NCCL stream failed: {other:?}",
                        shared.rank
                    ));
                    return Err(self.break_group(&mut comm, error));
                }
            }
            let mut async_error = nccl_sys::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator.
            unsafe { nccl_sys::ncclCommGetAsyncError(raw, &mut async_error) };
            if async_error != nccl_sys::ncclResult_t::ncclSuccess
                && async_error != nccl_sys::ncclResult_t::ncclInProgress
            {
                let error = collective(format!(
                    "rank {}: NCCL reported {async_error:?}",
                    shared.rank
                ));
                return Err(self.break_group(&mut comm, error));
            }
            if Instant::now() > deadline {
                let error = collective(format!(
                    "rank {} of {}: an all-gather did not complete within {:?} (a rank is \
                     missing or called a different collective)",
                    shared.rank, shared.world, shared.timeout
                ));
                return Err(self.break_group(&mut comm, error));
            }
            // Exchanges usually finish within microseconds: yield first (a sleep costs the
            // timer slack, ~50 µs), sleep only once the wait is long.
            if Instant::now() + shared.timeout < deadline + Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

impl<B: CudaBackend> Collective<B> for NcclGroup {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_gather_host(&self, block: &[u64]) -> Result<Vec<u64>, InvariantError> {
        let shared = &self.shared;
        let world = shared.world;
        let stream = &shared.stream;
        let copy_err = |e| collective(format!("rank {}: host copy: {e:?}", shared.rank));
        // Lengths first: NCCL itself cannot tell blocks of different lengths apart.
        let gather = |words: &[u64]| -> Result<Vec<u64>, InvariantError> {
            let mut envelopes = Self::lock(&shared.envelopes);
            if envelopes
                .as_ref()
                .is_none_or(|b| b.send.len() < words.len())
            {
                let room = words.len().max(HOST_ENVELOPE);
                *envelopes = Some(Envelopes::new(stream, world, room).map_err(copy_err)?);
            }
            let Some(bufs) = envelopes.as_mut() else {
                unreachable!("made above")
            };
            stream.context().bind_to_thread().map_err(copy_err)?;
            bufs.host_send.as_mut_slice().map_err(copy_err)?[..words.len()].copy_from_slice(words);
            // Copy in, gather and copy out are ordered on the group's stream; one wait.
            stream
                .memcpy_htod(&bufs.host_send, &mut bufs.send)
                .map_err(copy_err)?;
            let s = cudarc::driver::DevicePtr::device_ptr(&bufs.send, stream).0;
            let r = cudarc::driver::DevicePtr::device_ptr(&bufs.recv, stream).0;
            let (recv, host_recv) = (&bufs.recv, &mut bufs.host_recv);
            self.all_gather_raw(
                s,
                r,
                words.len(),
                nccl_sys::ncclDataType_t::ncclUint64,
                || stream.memcpy_dtoh(recv, host_recv),
            )?;
            // Rank r's block sits at `r · words.len()` (NCCL's layout for this count).
            Ok(bufs.host_recv.as_slice().map_err(copy_err)?[..words.len() * world].to_vec())
        };
        self.check_device_waits()?;
        // One fixed-size envelope per rank, `[length, first words]`, so NCCL's counts agree
        // whatever the blocks are; a longer block sends its remainder in a second exchange.
        let head = block.len().min(HOST_ENVELOPE - 1);
        let mut envelope = vec![0u64; HOST_ENVELOPE];
        envelope[0] = block.len() as u64;
        envelope[1..=head].copy_from_slice(&block[..head]);
        let envelopes = gather(&envelope)?;
        let lengths: Vec<u64> = envelopes.chunks(HOST_ENVELOPE).map(|e| e[0]).collect();
        if lengths.iter().any(|&l| l != block.len() as u64) {
            let error = collective(format!(
                "host blocks of different lengths across ranks: {lengths:?} words"
            ));
            return Err(self.break_group(&mut Self::lock(&shared.comm), error));
        }
        let rest = if block.len() > head {
            gather(&block[head..])?
        } else {
            Vec::new()
        };
        let tail = block.len() - head;
        Ok((0..world)
            .flat_map(|r| {
                let first = &envelopes[r * HOST_ENVELOPE + 1..][..head];
                let last = &rest[r * tail..(r + 1) * tail];
                first.iter().chain(last).copied()
            })
            .collect())
    }

    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, InvariantError> {
        let shared = &self.shared;
        if block.dtype() != DType::F32 {
            return Err(collective(format!(
                "all_gather expects an f32 block, got {:?}",
                block.dtype()
            )));
        }
        let len = block.dims()[0];
        let tensor = into_contiguous(B::into_cuda(block));
        if tensor.device != shared.device {
            return Err(InvariantError::DeviceMismatch {
                arg: "block",
                reference: "group",
                expected: format!("{:?} (the NCCL group's device)", shared.device),
                got: format!("{:?}", tensor.device),
            });
        }
        let client = tensor.client.clone();
        let words = len * shared.world;
        let out = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
            client.clone(),
            tensor.device.clone(),
            [words].into(),
            DType::F32,
        );
        if len > 0 {
            self.enqueue_all_gather(&client, &tensor, &out, len)?;
        }
        Ok(B::from_cuda(out))
    }

    fn settle(&self) -> Result<(), InvariantError> {
        self.settle_exchanges()
    }

    fn end_call(&self) -> Result<(), InvariantError> {
        if !self.shared.deferred.load(Ordering::Relaxed) {
            return self.settle_exchanges();
        }
        match Self::lock(&self.shared.broken).clone() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Breaks the group (the first error stays) and aborts the communicator; peers that wait
    /// in an exchange with this rank fail by their timeout.
    fn fail(&self, error: InvariantError) {
        let mut comm = Self::lock(&self.shared.comm);
        if Self::lock(&self.shared.broken).is_none() {
            self.break_group(&mut comm, error);
        }
    }

    fn device(&self) -> Option<B::Device> {
        Some(B::device_from_cuda(&self.shared.device))
    }
}
