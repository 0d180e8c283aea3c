//! The NCCL [`Collective`] for the CUDA backends: one communicator per GPU, through cudarc's
//! NCCL bindings (the same `libnccl` cubecl-cuda loads).
//!
//! # Ordering with Burn's compute
//! cubecl-cuda 0.10 keeps its `CUstream` private, so NCCL cannot be enqueued behind the shard's
//! compute on that stream. Each exchange therefore (1) waits for *this thread's* cubecl stream
//! (`client.sync()`, a stream wait, not a device-wide one), (2) runs `ncclAllGather` on the
//! group's own stream of the same primary context, directly on cubecl's buffers, and (3) polls
//! that stream until it is done or the group's timeout passes. Nothing is copied through the
//! host; the wait costs one round-trip per exchange (one in the forward, one in the backward).
//!
//! # Failure
//! A peer that does not arrive within the timeout makes the waiting ranks abort their
//! communicator and return [`InvariantError::Collective`]; the group is broken for good after
//! that (every later call returns the same error). `ncclCommInitRank` is run on a watchdog
//! thread, so a rank that never joins fails [`NcclGroup::new`] in bounded time too.
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Tensor, TensorPrimitive, backend::Backend};
use burn_cubecl::{
    BoolElement, CubeBackend, FloatElement, IntElement, kernel::into_contiguous, tensor::CubeTensor,
};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cudarc::driver::{CudaContext, CudaStream, sys as driver_sys};
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::Collective;
use crate::InvariantError;

/// How long [`NcclGroup`] waits for the other ranks, by default.
pub const NCCL_DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

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
        Collective::<CubeBackend<CudaRuntime, f32, i32, u8>>::all_gather_host(&group, &[0])?;
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
                timeout,
                stream,
                comm: Mutex::new(Some(comm)),
                broken: Mutex::new(None),
            }),
        }
    }

    /// The GPU of this rank.
    pub fn device(&self) -> &CudaDevice {
        &self.shared.device
    }

    fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
        mutex.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fail(&self, comm: &mut Option<RawComm>, error: InvariantError) -> InvariantError {
        // Aborting frees NCCL's kernels from waiting on peers that will not come.
        comm.take();
        *Self::lock(&self.shared.broken) = Some(error.clone());
        error
    }

    /// Runs one all-gather of `count` elements of `dtype` from `send` into `recv` on the
    /// group's stream and waits for it, bounded by the timeout.
    fn all_gather_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: nccl_sys::ncclDataType_t,
    ) -> Result<(), InvariantError> {
        let shared = &self.shared;
        let mut comm = Self::lock(&shared.comm);
        if let Some(error) = Self::lock(&shared.broken).clone() {
            return Err(error);
        }
        let Some(raw) = comm.as_ref().map(|c| c.0) else {
            return Err(collective("the NCCL communicator was aborted".into()));
        };
        shared
            .stream
            .context()
            .bind_to_thread()
            .map_err(|e| collective(format!("binding the CUDA context: {e:?}")))?;
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
            return Err(self.fail(&mut comm, error));
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
                    return Err(self.fail(&mut comm, error));
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
                return Err(self.fail(&mut comm, error));
            }
            if Instant::now() > deadline {
                let error = collective(format!(
                    "rank {} of {}: an all-gather did not complete within {:?} (a rank is \
                     missing or called a different collective)",
                    shared.rank, shared.world, shared.timeout
                ));
                return Err(self.fail(&mut comm, error));
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// Backends whose float tensors live in cubecl-cuda buffers, so [`NcclGroup`] can hand them to
/// NCCL: `CubeBackend<CudaRuntime, ..>`, `Fusion` of it, and `Autodiff` of either.
pub trait NcclBackend: Backend {
    /// The tensor's cubecl-cuda form (pending fusion work is executed first).
    fn into_cuda(tensor: Tensor<Self, 1>) -> CubeTensor<CudaRuntime>;
    /// Back from [`NcclBackend::into_cuda`]'s form.
    fn from_cuda(tensor: CubeTensor<CudaRuntime>) -> Tensor<Self, 1>;
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> NcclBackend
    for CubeBackend<CudaRuntime, F, I, BT>
{
    fn into_cuda(tensor: Tensor<Self, 1>) -> CubeTensor<CudaRuntime> {
        tensor.into_primitive().tensor()
    }

    fn from_cuda(tensor: CubeTensor<CudaRuntime>) -> Tensor<Self, 1> {
        Tensor::from_primitive(TensorPrimitive::Float(tensor))
    }
}

impl<B: burn_fusion::FusionBackend + NcclBackend> NcclBackend for burn_fusion::Fusion<B> {
    fn into_cuda(tensor: Tensor<Self, 1>) -> CubeTensor<CudaRuntime> {
        let tensor = tensor.into_primitive().tensor();
        let client = tensor.client.clone();
        let inner = client.resolve_tensor_float::<B>(tensor);
        B::into_cuda(Tensor::from_primitive(TensorPrimitive::Float(inner)))
    }

    fn from_cuda(tensor: CubeTensor<CudaRuntime>) -> Tensor<Self, 1> {
        use burn_fusion::{NoOp, get_client, stream::OperationStreams};
        use burn_ir::{InitOperationIr, OperationIr};
        let inner = B::from_cuda(tensor);
        let (shape, dtype, device) = (inner.shape(), inner.dtype(), inner.device());
        let client = get_client::<B>(&device);
        let handle = B::float_tensor_handle(inner.into_primitive().tensor());
        let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
        let out = client
            .register(
                OperationStreams::default(),
                OperationIr::Init(desc),
                NoOp::<B>::new(),
            )
            .remove(0);
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }
}

impl<B: NcclBackend, C: burn_autodiff::checkpoint::strategy::CheckpointStrategy> NcclBackend
    for burn_autodiff::Autodiff<B, C>
{
    fn into_cuda(tensor: Tensor<Self, 1>) -> CubeTensor<CudaRuntime> {
        B::into_cuda(tensor.inner())
    }

    fn from_cuda(tensor: CubeTensor<CudaRuntime>) -> Tensor<Self, 1> {
        Tensor::from_inner(B::from_cuda(tensor))
    }
}

impl<B: NcclBackend> Collective<B> for NcclGroup {
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
            stream.context().bind_to_thread().map_err(copy_err)?;
            let send = stream.clone_htod(words).map_err(copy_err)?;
            let recv = stream
                .alloc_zeros::<u64>(words.len() * world)
                .map_err(copy_err)?;
            // The copies above are ordered before the all-gather on the same stream.
            let (s, _s) = cudarc::driver::DevicePtr::device_ptr(&send, stream);
            let (r, _r) = cudarc::driver::DevicePtr::device_ptr(&recv, stream);
            self.all_gather_raw(s, r, words.len(), nccl_sys::ncclDataType_t::ncclUint64)?;
            stream.clone_dtoh(&recv).map_err(copy_err)
        };
        let lengths = gather(&[block.len() as u64])?;
        if lengths.iter().any(|&l| l != block.len() as u64) {
            let error = collective(format!(
                "host blocks of different lengths across ranks: {lengths:?} words"
            ));
            return Err(self.fail(&mut Self::lock(&shared.comm), error));
        }
        if block.is_empty() {
            return Ok(Vec::new());
        }
        gather(block)
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
        let out = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
            client.clone(),
            tensor.device.clone(),
            [len * shared.world].into(),
            DType::F32,
        );
        if len > 0 {
            let resource = |t: &CubeTensor<CudaRuntime>| {
                client
                    .get_resource(t.handle.clone())
                    .map_err(|e| collective(format!("rank {}: cubecl buffer: {e:?}", shared.rank)))
            };
            let (send, recv) = (resource(&tensor)?, resource(&out)?);
            // The block is written on this thread's cubecl stream: wait for it.
            cubecl::future::block_on(client.sync())
                .map_err(|e| collective(format!("rank {}: cubecl sync: {e:?}", shared.rank)))?;
            self.all_gather_raw(
                send.resource().ptr,
                recv.resource().ptr,
                len,
                nccl_sys::ncclDataType_t::ncclFloat32,
            )?;
            // `send`/`recv` (the buffers' leases) end here, after NCCL is done with them.
        }
        Ok(B::from_cuda(out))
    }
}
