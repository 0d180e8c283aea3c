//! `Sm90`: the hand-written TMA + WGMMA kernels of `kernels/`, compiled by cubecl's NVRTC path
//! for `sm_90a` at first use (one entry point per compilation, cached by cubecl) and launched
//! on cubecl's own stream with cubecl's buffers, so they order with every other Burn op and need
//! no host synchronisation. The TMA maps are cubecl tensor-map bindings: cubecl encodes them from
//! the buffers at launch, on its server thread, so a launch never waits for a device address.
//! The ABI (maps, buffers, parameter blocks, grids) is `kernels/README.md`.
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use burn::tensor::{DType, Shape, ops::FloatTensorOps};
use burn_cubecl::{
    kernel::into_contiguous,
    ops::numeric::{empty_device_contiguous_dtype, zeros_client},
    tensor::CubeTensor,
};
use cubecl::cuda::{CudaCompiler, CudaComputeKernel, CudaDevice, CudaRuntime};
use cubecl::prelude::*;
use cubecl::server::{
    Binding, KernelArguments, MetadataBindingInfo, TensorMapBinding, TensorMapMeta,
};
use cubecl::zspace::metadata::Metadata;
use cubecl::{CompilationError, Compiler, CubeTask};
use cubecl_cpp::shared::{Body, Elem, Flags, Item, SharedMemory};

const COMMON: &str = include_str!("../../kernels/common.cuh");
const GEMM_UNIT: &str = include_str!("../../kernels/gemm_sm90.cu");
const LOGP_UNIT: &str = include_str!("../../kernels/linear_logp_sm90.cu");
const STREAM_SYNC_UNIT: &str = include_str!("../../kernels/stream_sync.cu");

/// Fixed host constants of the backward (part of the numerics, kernels/README.md).
const TOKEN_CHUNK: usize = 4096;
const VOCAB_CHUNK: usize = 8192;
/// Forward vocabulary segment of `ib_logp_fwd`.
const LOGP_SEGMENT: usize = 1024;

const GEMM_BIAS: u32 = 1;
const GEMM_ACC_LOAD: u32 = 2;
const GEMM_ACC_STORE: u32 = 4;
const GEMM_STORE_C: u32 = 8;
const LOGP_HAS_BIAS: u32 = 1;
const LOGP_HAS_IGNORE: u32 = 2;
const DBIAS_ACC_LOAD: u32 = 4;
const DBIAS_ACC_STORE: u32 = 8;
const DBIAS_STORE: u32 = 16;

/// Big tile: 128×256×64, 4 stages, 2-CTA clusters. Small tile: 64×64×64 (M ≤ 64), the same
/// per-element arithmetic (tested bitwise), so the choice by M keeps row invariance.
const BIG_SMEM: usize = 1024 + 4 * 49152 + 64;
const SMALL_SMEM: usize = 1024 + 8 * 16384 + 128;
const LOGP_SMEM: usize = 1024 + 4 * 49152 + 64;
const LOGP_BWD_SMEM: usize = 1024 + 4 * 49152 + 8192 + 64;

/// Compute capability of a CUDA device (major * 10 + minor), cached.
pub(crate) fn compute_capability(device: &CudaDevice) -> Option<u32> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Option<u32>>>> = OnceLock::new();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    *cache.entry(device.index).or_insert_with(|| {
        use cudarc::driver::{result, sys::CUdevice_attribute::*};
        result::init().ok()?;
        let dev = result::device::get(device.index as i32).ok()?;
        // SAFETY: plain attribute queries on a valid device handle.
        let (major, minor) = unsafe {
            (
                result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                    .ok()?,
                result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
                    .ok()?,
            )
        };
        Some((major * 10 + minor) as u32)
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    Gemm,
    Logp,
    /// `kernels/stream_sync.cu`: plain CUDA for any architecture, compiled without `common.cuh`.
    StreamSync,
}

/// One entry point of `kernels/`, compiled alone (`IB_SELECT`) to keep NVRTC time to seconds.
struct RawKernel {
    entry: String,
    unit: Unit,
    block: u32,
    smem: usize,
}

impl KernelMetadata for RawKernel {
    fn id(&self) -> KernelId {
        // The sources are compile-time constants: the entry name identifies the binary.
        KernelId::new::<Self>()
            .info((self.entry.clone(), self.smem))
            .cube_dim(CubeDim::new_1d(self.block))
    }

    fn address_type(&self) -> StorageType {
        u32::as_type_native_unchecked().storage_type()
    }
}

/// cubecl-cuda reads only the dynamic shared-memory size from `repr`.
fn stub_repr(entry: &str, cube_dim: CubeDim, smem: usize) -> CudaComputeKernel {
    let shared_memories = match smem {
        0 => vec![],
        length => vec![SharedMemory::Array {
            index: 0,
            item: Item::scalar(Elem::U8, true),
            length,
            align: 16,
            offset: 0,
        }],
    };
    CudaComputeKernel {
        tensor_maps: vec![],
        buffers: vec![],
        scalars: vec![],
        info: Default::default(),
        meta_static_len: 0,
        body: Body {
            instructions: vec![],
            shared_memories,
            pipelines: vec![],
            barriers: vec![],
            const_arrays: vec![],
            local_arrays: vec![],
            info_by_ptr: false,
            has_dynamic_meta: false,
            address_type: Item::scalar(Elem::U32, true),
        },
        cube_dim,
        cluster_dim: None,
        extensions: vec![],
        flags: Flags::default(),
        items: Default::default(),
        kernel_name: entry.to_string(),
    }
}

impl CubeTask<CudaCompiler> for RawKernel {
    fn compile(
        &self,
        _compiler: &mut CudaCompiler,
        _options: &<CudaCompiler as Compiler>::CompilationOptions,
        _mode: ExecutionMode,
        _address_type: StorageType,
    ) -> Result<CompiledKernel<CudaCompiler>, CompilationError> {
        let selected = |unit: &str| {
            format!(
                "#define IB_SELECT\n#define IB_ENTRY_{}\n{COMMON}\n{unit}",
                self.entry
            )
        };
        let source = match self.unit {
            Unit::Gemm => selected(GEMM_UNIT),
            Unit::Logp => selected(LOGP_UNIT),
            Unit::StreamSync => STREAM_SYNC_UNIT.to_string(),
        };
        let cube_dim = CubeDim::new_1d(self.block);
        Ok(CompiledKernel {
            entrypoint_name: self.entry.clone(),
            debug_name: None,
            source,
            repr: Some(stub_repr(&self.entry, cube_dim, self.smem)),
            cube_dim,
            debug_info: None,
        })
    }
}

/// A kernel's by-value parameter struct: scalars at byte offsets (the largest struct is 40
/// bytes; the driver copies only as many bytes as the kernel declares).
struct Params([u64; 5]);

impl Params {
    fn new() -> Self {
        Self([0; 5])
    }

    fn u32_at(mut self, offset: usize, value: u32) -> Self {
        let (word, shift) = (offset / 8, (offset % 8) * 8);
        self.0[word] = (self.0[word] & !(0xFFFF_FFFFu64 << shift)) | ((value as u64) << shift);
        self
    }

    fn u64_at(mut self, offset: usize, value: u64) -> Self {
        debug_assert_eq!(offset % 8, 0);
        self.0[offset / 8] = value;
        self
    }

    /// The 24 bytes both linear_logp structs start with (`LogpFwdParams`, and the head of
    /// `LogpBwdParams`): rows, vocab columns, hidden size, flags, ignore index.
    fn logp(rows: usize, cols: usize, d: usize, flags: u32, ignore_index: Option<i64>) -> Self {
        Self::new()
            .u32_at(0, rows as u32)
            .u32_at(4, cols as u32)
            .u32_at(8, d as u32)
            .u32_at(12, flags)
            .u64_at(16, ignore_index.unwrap_or(0) as u64)
    }
}

/// Kernel parameters in cubecl's order: the maps, their buffers, `buffers`, then `params`.
fn launch(
    client: &ComputeClient<CudaRuntime>,
    kernel: RawKernel,
    grid: usize,
    maps: Vec<TensorMapBinding>,
    buffers: Vec<Binding>,
    params: Params,
) {
    let info = params.0.to_vec();
    let words = info.len();
    let args = KernelArguments::new()
        .with_tensor_maps(maps)
        .with_buffers(buffers)
        .with_info(MetadataBindingInfo::new(info, words));
    client.launch(
        Box::new(kernel),
        CubeCount::Static(grid.max(1) as u32, 1, 1),
        args,
    );
}

/// Launches entry `entry` of `kernels/stream_sync.cu` on the client's stream: `(buffers...,
/// SyncParams { flags, seq, timeout_ns, words })`.
pub(crate) fn launch_stream_sync(
    client: &ComputeClient<CudaRuntime>,
    entry: &str,
    [grid, block]: [u32; 2],
    buffers: Vec<Binding>,
    [flags, seq, timeout_ns, words]: [u64; 4],
) {
    let params = Params::new()
        .u64_at(0, flags)
        .u32_at(8, seq as u32)
        .u64_at(16, timeout_ns)
        .u64_at(24, words);
    let kernel = RawKernel {
        entry: entry.into(),
        unit: Unit::StreamSync,
        block,
        smem: 0,
    };
    launch(client, kernel, grid as usize, vec![], buffers, params);
}

fn suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => unreachable!("the registry admits only bf16/f16 for Sm90, got {other:?}"),
    }
}

fn sm_count(client: &ComputeClient<CudaRuntime>) -> usize {
    client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(132)
        .max(2) as usize
}

/// A TMA-readable operand: a row-major buffer whose row stride is a multiple of 16 bytes and
/// whose base is 16-byte aligned (copied into such a buffer when it is not).
struct Operand {
    tensor: CubeTensor<CudaRuntime>,
    cols: usize,
    ld: usize,
}

impl Operand {
    fn new(t: CubeTensor<CudaRuntime>) -> Self {
        let cols = t.meta.shape()[1];
        let strides = t.meta.strides().to_vec();
        let elem = t.dtype.size();
        // cubecl's CUDA allocations are 512-byte aligned, so the base is 16-byte aligned exactly
        // when the view's byte offset is: TMA needs both that and 16-byte row strides.
        let aligned_base = t.handle.offset_start.unwrap_or(0).is_multiple_of(16);
        let tma_ready = strides[1] == 1
            && (strides[0] * elem).is_multiple_of(16)
            && strides[0] >= cols
            && aligned_base;
        let (tensor, ld) = if tma_ready {
            let ld = strides[0];
            (t, ld)
        } else {
            padded_copy(t)
        };
        Self { tensor, cols, ld }
    }

    /// A map of rows `[row0, row0 + rows)` of this operand.
    fn map(&self, row0: usize, rows: usize) -> TensorMapBinding {
        self.map_columns(row0, rows, self.cols)
    }

    /// A map of the first `cols` columns of rows `[row0, row0 + rows)`: box 64×64, 128-byte
    /// swizzle, zero fill out of bounds (the kernels rely on it for every tail), L2 promotion
    /// 256 B.
    fn map_columns(&self, row0: usize, rows: usize, cols: usize) -> TensorMapBinding {
        let elem = self.tensor.dtype.size();
        let binding = self
            .tensor
            .handle
            .clone()
            .offset_start((row0 * self.ld * elem) as u64)
            .binding();
        let meta = TensorMapMeta {
            format: TensorMapFormat::Tiled(TiledArgs::new([64usize, 64].into())),
            metadata: Metadata::new([rows.max(1), cols.max(1)], [self.ld, 1]),
            elem_stride: [1usize, 1].into(),
            interleave: TensorMapInterleave::None,
            swizzle: TensorMapSwizzle::B128,
            prefetch: TensorMapPrefetch::B256,
            oob_fill: OobFill::Zero,
            storage_ty: self.tensor.dtype.into(),
        };
        TensorMapBinding::new(binding, meta)
    }

    fn binding(&self) -> Binding {
        self.tensor.handle.clone().binding()
    }
}

/// Copies `t` into a TMA-readable buffer and returns it with its row stride.
///
/// cubecl's pitched copy (rows on the allocator's pitch, 16-byte multiples on CUDA) reads any
/// strides. Zeros + `slice_assign` from a dense source with odd rows gave wrong rows ≥ 1 under
/// Fusion (whose outputs are dense), so that path only ever sees the pitched copy.
fn padded_copy(t: CubeTensor<CudaRuntime>) -> (CubeTensor<CudaRuntime>, usize) {
    let (rows, cols) = (t.meta.shape()[0], t.meta.shape()[1]);
    let (client, device, dtype) = (t.client.clone(), t.device.clone(), t.dtype);
    let pitched = cubecl::std::tensor::into_contiguous_pitched(&client, t.binding(), dtype.into());
    let pitched = CubeTensor::new(
        client.clone(),
        pitched.handle,
        *pitched.metadata,
        device.clone(),
        dtype,
    );
    let ld = pitched.meta.strides()[0];
    if pitched.meta.strides()[1] == 1 && (ld * dtype.size()).is_multiple_of(16) && ld >= cols {
        return (pitched, ld);
    }
    let ld = cols.div_ceil(8).max(1) * 8;
    let wide = zeros_client(client, device, Shape::new([rows, ld]), dtype);
    let window = [(0..rows).into(), (0..cols).into()];
    (Ops::float_slice_assign(wide, &window, pitched), ld)
}

type Ops = burn_cubecl::CubeBackend<CudaRuntime, f32, i32, u8>;

fn empty(
    like: &CubeTensor<CudaRuntime>,
    shape: Vec<usize>,
    dtype: DType,
) -> CubeTensor<CudaRuntime> {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape),
        dtype,
    )
}

fn zeros(
    like: &CubeTensor<CudaRuntime>,
    shape: Vec<usize>,
    dtype: DType,
) -> CubeTensor<CudaRuntime> {
    super::zeros(like, shape, dtype)
}

#[derive(Debug, Clone, Copy)]
enum Layout {
    Nn,
    Nt,
    Tn,
}

/// The output side of one GEMM launch.
struct GemmOut<'a> {
    c: &'a CubeTensor<CudaRuntime>,
    acc: Option<&'a CubeTensor<CudaRuntime>>,
    bias: Option<&'a CubeTensor<CudaRuntime>>,
    flags: u32,
    ldc: usize,
    c_offset: usize,
}

/// One GEMM launch. `(m, n, k)` are the product's dimensions; the maps describe the operands
/// in the layout's storage order (kernels/README.md, "Layouts and maps").
#[allow(clippy::too_many_arguments)]
fn gemm_launch(
    layout: Layout,
    dtype: DType,
    a: (&Operand, TensorMapBinding),
    b: (&Operand, TensorMapBinding),
    [m, n, k]: [usize; 3],
    out: GemmOut<'_>,
) {
    let client = &out.c.client;
    let small = m <= 64 && !matches!(layout, Layout::Tn);
    let (bm, bn, block, smem, cluster, variant) = if small {
        (64, 64, 256, SMALL_SMEM, 1, "_small")
    } else {
        (128, 256, 384, BIG_SMEM, 2, "")
    };
    let name = match layout {
        Layout::Nn => "nn",
        Layout::Nt => "nt",
        Layout::Tn => "tn",
    };
    // Small-tile entries are named ib_gemm_<L>_small_<T>.
    let entry = format!("ib_gemm_{name}{variant}_{}", suffix(dtype));
    let groups = m.div_ceil(bm).div_ceil(cluster) * n.div_ceil(bn);
    let grid = cluster * groups.min(sm_count(client) / cluster).max(1);
    let flags = out.flags | if out.bias.is_some() { GEMM_BIAS } else { 0 };
    let params = Params::new()
        .u32_at(0, m as u32)
        .u32_at(4, n as u32)
        .u32_at(8, k as u32)
        .u32_at(12, flags)
        .u64_at(16, out.ldc as u64)
        .u64_at(24, out.c_offset as u64);
    let c = out.c.handle.clone().binding();
    // The operands are buffers too: cubecl orders only buffer arguments across streams.
    let buffers = vec![
        a.0.binding(),
        b.0.binding(),
        out.bias
            .map_or_else(|| c.clone(), |t| t.handle.clone().binding()),
        c.clone(),
        out.acc.map_or(c, |t| t.handle.clone().binding()),
    ];
    launch(
        client,
        RawKernel {
            entry,
            unit: Unit::Gemm,
            block,
            smem,
        },
        grid,
        vec![a.1, b.1],
        buffers,
        params,
    );
}

/// One whole product `C[m, n]` (reduction length `k`) in `layout`, stored in a fresh buffer.
fn product(
    layout: Layout,
    a: CubeTensor<CudaRuntime>,
    b: CubeTensor<CudaRuntime>,
    bias: Option<CubeTensor<CudaRuntime>>,
    [m, n, k]: [usize; 3],
) -> CubeTensor<CudaRuntime> {
    let dtype = a.dtype;
    let c = empty(&a, vec![m, n], dtype);
    // Rows each operand's map covers, in the layout's storage order.
    let (a_rows, b_rows) = match layout {
        Layout::Nn => (m, k),
        Layout::Nt => (m, n),
        Layout::Tn => (k, k),
    };
    let bias = bias.map(into_contiguous);
    let (a, b) = (Operand::new(a), Operand::new(b));
    let maps = (a.map(0, a_rows), b.map(0, b_rows));
    let out = GemmOut {
        c: &c,
        acc: None,
        bias: bias.as_ref(),
        flags: GEMM_STORE_C,
        ldc: n,
        c_offset: 0,
    };
    gemm_launch(layout, dtype, (&a, maps.0), (&b, maps.1), [m, n, k], out);
    c
}

/// `lhs [M, K] · rhs [K, N] (+ bias)` (NN layout).
pub(crate) fn matmul(
    lhs: CubeTensor<CudaRuntime>,
    rhs: CubeTensor<CudaRuntime>,
    bias: Option<CubeTensor<CudaRuntime>>,
) -> CubeTensor<CudaRuntime> {
    let (m, k, n) = (
        lhs.meta.shape()[0],
        lhs.meta.shape()[1],
        rhs.meta.shape()[1],
    );
    if m == 0 || n == 0 || k == 0 {
        // Nothing to reduce (the kernels need K ≥ 1): the output is the bias or zeros.
        return super::matmul(lhs, rhs, bias);
    }
    product(Layout::Nn, lhs, rhs, bias, [m, n, k])
}

/// `grad [M, N] · rhsᵀ` with `rhs [K, N]` (NT layout): `[M, K]`.
pub(crate) fn matmul_grad_lhs(
    grad: CubeTensor<CudaRuntime>,
    rhs: CubeTensor<CudaRuntime>,
) -> CubeTensor<CudaRuntime> {
    let (m, n, k) = (
        grad.meta.shape()[0],
        grad.meta.shape()[1],
        rhs.meta.shape()[0],
    );
    if m == 0 || k == 0 || n == 0 {
        return zeros(&grad, vec![m, k], grad.dtype);
    }
    product(Layout::Nt, grad, rhs, None, [m, k, n])
}

/// `lhsᵀ · grad` with `lhs [M, K]`, `grad [M, N]` (TN layout; the reduction runs over the
/// batch rows in ascending 64-row blocks): `[K, N]`.
pub(crate) fn matmul_grad_rhs(
    lhs: CubeTensor<CudaRuntime>,
    grad: CubeTensor<CudaRuntime>,
) -> CubeTensor<CudaRuntime> {
    let (m, k, n) = (
        lhs.meta.shape()[0],
        lhs.meta.shape()[1],
        grad.meta.shape()[1],
    );
    if m == 0 || k == 0 || n == 0 {
        return zeros(&grad, vec![k, n], grad.dtype);
    }
    product(Layout::Tn, lhs, grad, None, [k, n, m])
}

/// Targets as contiguous i32 with ignored rows mapped to −1 (never a valid target), so an
/// ignore index outside the i32 range still matches exactly.
fn normalized_targets(
    targets: CubeTensor<CudaRuntime>,
    ignore_index: Option<i64>,
) -> (CubeTensor<CudaRuntime>, Option<i64>) {
    use burn::tensor::ops::IntTensorOps;
    let targets = match ignore_index {
        // Already in the normalized form (the TP leaves' sentinel): nothing to remap.
        Some(-1) => targets,
        Some(ignore) => {
            let is_ignored =
                Ops::int_equal_elem(targets.clone(), ignore.into(), burn::tensor::BoolDType::U8);
            Ops::int_mask_fill(targets, is_ignored, (-1i64).into())
        }
        None => targets,
    };
    let targets = if targets.dtype == DType::I32 {
        targets
    } else {
        Ops::int_cast(targets, burn::tensor::IntDType::I32)
    };
    (into_contiguous(targets), ignore_index.map(|_| -1))
}

/// Forward: `[N, 2]` f32 `(logp, lse)`.
pub(crate) fn linear_logp(
    hidden: CubeTensor<CudaRuntime>,
    weight: CubeTensor<CudaRuntime>,
    bias: Option<CubeTensor<CudaRuntime>>,
    targets: CubeTensor<CudaRuntime>,
    ignore_index: Option<i64>,
) -> CubeTensor<CudaRuntime> {
    let (n, d, v) = (
        hidden.meta.shape()[0],
        hidden.meta.shape()[1],
        weight.meta.shape()[0],
    );
    let dtype = hidden.dtype;
    let client = hidden.client.clone();
    // The owning CTA writes z_t into logp; rows whose target matches no column keep NaN.
    let logp = Ops::float_full(
        Shape::new([n]),
        f32::NAN.into(),
        &hidden.device,
        burn::tensor::FloatDType::F32,
    );
    let lse = empty(&hidden, vec![n], DType::F32);
    let segments = v.div_ceil(LOGP_SEGMENT);
    let workspace = empty(&hidden, vec![segments * n * 2], DType::F32);
    let (targets, ignore_index) = normalized_targets(targets, ignore_index);
    let bias = bias.map(into_contiguous);
    let (h, w) = (Operand::new(hidden), Operand::new(weight));
    let flags =
        bias.as_ref().map_or(0, |_| LOGP_HAS_BIAS) | ignore_index.map_or(0, |_| LOGP_HAS_IGNORE);
    let params = || Params::logp(n, v, d, flags, ignore_index);
    let outputs = || {
        vec![
            targets.handle.clone().binding(),
            logp.handle.clone().binding(),
            lse.handle.clone().binding(),
            workspace.handle.clone().binding(),
        ]
    };
    let mut buffers = vec![
        h.binding(),
        w.binding(),
        bias.as_ref()
            .map_or_else(|| h.binding(), |b| b.handle.clone().binding()),
    ];
    buffers.extend(outputs());
    let items = n.div_ceil(128).div_ceil(2) * segments;
    let grid = 2 * items.min(sm_count(&client) / 2).max(1);
    let entry = format!("ib_logp_fwd_{}", suffix(dtype));
    launch(
        &client,
        RawKernel {
            entry,
            unit: Unit::Logp,
            block: 384,
            smem: LOGP_SMEM,
        },
        grid,
        vec![h.map(0, n), w.map(0, v)],
        buffers,
        params(),
    );
    let merge = RawKernel {
        entry: "ib_logp_merge".into(),
        unit: Unit::Logp,
        block: 256,
        smem: 0,
    };
    launch(&client, merge, n.div_ceil(8), vec![], outputs(), params());
    let logp = Ops::float_reshape(logp, Shape::new([n, 1]));
    let lse = Ops::float_reshape(lse, Shape::new([n, 1]));
    Ops::float_cat(vec![logp, lse], 1)
}

/// Flags of chunk `index` of `count` in an f32 accumulation over chunks: load the running sum
/// after the first, store it before the last, write the rounded result at the last.
fn chunk_flags(index: usize, count: usize, [load, store, finish]: [u32; 3]) -> u32 {
    let mut flags = 0;
    if index > 0 {
        flags |= load;
    }
    if index + 1 < count {
        flags |= store;
    } else {
        flags |= finish;
    }
    flags
}

/// Gradients of the backward: `(dHidden, dWeight, dBias)`.
pub(crate) type LogpGrads = (
    CubeTensor<CudaRuntime>,
    CubeTensor<CudaRuntime>,
    Option<CubeTensor<CudaRuntime>>,
);

/// Backward: the chunked host loop of kernels/README.md ("Backward").
pub(crate) fn linear_logp_backward(
    hidden: CubeTensor<CudaRuntime>,
    weight: CubeTensor<CudaRuntime>,
    bias: Option<CubeTensor<CudaRuntime>>,
    targets: CubeTensor<CudaRuntime>,
    ignore_index: Option<i64>,
    stats: CubeTensor<CudaRuntime>,
    grad: CubeTensor<CudaRuntime>,
) -> LogpGrads {
    let (n, d, v) = (
        hidden.meta.shape()[0],
        hidden.meta.shape()[1],
        weight.meta.shape()[0],
    );
    let dtype = hidden.dtype;
    let client = hidden.client.clone();
    let column = |t: &CubeTensor<CudaRuntime>, c: usize| {
        let col = Ops::float_slice(t.clone(), &[(0..n).into(), (c..c + 1).into()]);
        into_contiguous(Ops::float_reshape(into_contiguous(col), Shape::new([n])))
    };
    let (lse, g_logp, g_lse) = (column(&stats, 1), column(&grad, 0), column(&grad, 1));
    let (targets, ignore_index) = normalized_targets(targets, ignore_index);
    let bias = bias.map(into_contiguous);
    let d_hidden = empty(&hidden, vec![n, d], dtype);
    let d_weight = empty(&weight, vec![v, d], dtype);
    let d_bias = bias.as_ref().map(|b| empty(b, vec![v], b.dtype));
    if n == 0 || d == 0 {
        return (
            zeros(&hidden, vec![n, d], dtype),
            zeros(&weight, vec![v, d], dtype),
            bias.as_ref().map(|b| zeros(b, vec![v], b.dtype)),
        );
    }
    let (token_chunks, vocab_chunks) = (n.div_ceil(TOKEN_CHUNK), v.div_ceil(VOCAB_CHUNK));
    let rows = n.min(TOKEN_CHUNK);
    let dz = Operand::new(empty(&hidden, vec![rows, VOCAB_CHUNK], dtype));
    let dbias_part = empty(&hidden, vec![rows.div_ceil(128) * VOCAB_CHUNK], DType::F32);
    let dh_acc = (vocab_chunks > 1).then(|| empty(&hidden, vec![n, d], DType::F32));
    let dw_acc = (token_chunks > 1).then(|| empty(&weight, vec![v, d], DType::F32));
    let db_acc = bias
        .as_ref()
        .filter(|_| token_chunks > 1)
        .map(|b| empty(b, vec![v], DType::F32));
    let (h, w) = (Operand::new(hidden), Operand::new(weight));
    let base =
        bias.as_ref().map_or(0, |_| LOGP_HAS_BIAS) | ignore_index.map_or(0, |_| LOGP_HAS_IGNORE);
    let sms = sm_count(&client);
    for vi in 0..vocab_chunks {
        let (v0, vw) = (vi * VOCAB_CHUNK, VOCAB_CHUNK.min(v - vi * VOCAB_CHUNK));
        for ti in 0..token_chunks {
            let (t0, tw) = (ti * TOKEN_CHUNK, TOKEN_CHUNK.min(n - ti * TOKEN_CHUNK));
            let mut flags = base;
            if bias.is_some() {
                flags |= chunk_flags(
                    ti,
                    token_chunks,
                    [DBIAS_ACC_LOAD, DBIAS_ACC_STORE, DBIAS_STORE],
                );
            }
            let params = || {
                Params::logp(tw, vw, d, flags, ignore_index)
                    .u32_at(24, t0 as u32)
                    .u32_at(28, v0 as u32)
                    .u32_at(32, VOCAB_CHUNK as u32)
            };
            let any = h.binding();
            let dz_buffers = vec![
                h.binding(),
                w.binding(),
                bias.as_ref()
                    .map_or_else(|| any.clone(), |b| b.handle.clone().binding()),
                targets.handle.clone().binding(),
                lse.handle.clone().binding(),
                g_logp.handle.clone().binding(),
                g_lse.handle.clone().binding(),
                dz.binding(),
                dbias_part.handle.clone().binding(),
            ];
            let tiles = tw.div_ceil(128).div_ceil(2) * vw.div_ceil(256);
            let entry = format!("ib_logp_bwd_dz_{}", suffix(dtype));
            launch(
                &client,
                RawKernel {
                    entry,
                    unit: Unit::Logp,
                    block: 384,
                    smem: LOGP_BWD_SMEM,
                },
                2 * tiles.min(sms / 2).max(1),
                vec![h.map(t0, tw), w.map(v0, vw)],
                dz_buffers,
                params(),
            );
            if bias.is_some() {
                let entry = format!("ib_logp_bwd_dbias_{}", suffix(dtype));
                launch(
                    &client,
                    RawKernel {
                        entry,
                        unit: Unit::Logp,
                        block: 256,
                        smem: 0,
                    },
                    vw.div_ceil(256),
                    vec![],
                    vec![
                        dbias_part.handle.clone().binding(),
                        db_acc
                            .as_ref()
                            .map_or_else(|| any.clone(), |b| b.handle.clone().binding()),
                        d_bias
                            .as_ref()
                            .map_or_else(|| any.clone(), |b| b.handle.clone().binding()),
                    ],
                    params(),
                );
            }
            // dz's map covers only the live chunk: tw rows × vw columns.
            let dz_map = || dz.map_columns(0, tw, vw);
            // dH[t0..t0+tw] (+)= dz · W[v0..v0+vw], reduction over this vocabulary chunk.
            let flags_h = chunk_flags(
                vi,
                vocab_chunks,
                [GEMM_ACC_LOAD, GEMM_ACC_STORE, GEMM_STORE_C],
            );
            gemm_launch(
                Layout::Nn,
                dtype,
                (&dz, dz_map()),
                (&w, w.map(v0, vw)),
                [tw, d, vw],
                GemmOut {
                    c: &d_hidden,
                    acc: dh_acc.as_ref(),
                    bias: None,
                    flags: flags_h,
                    ldc: d,
                    c_offset: t0 * d,
                },
            );
            // dW[v0..v0+vw] (+)= dzᵀ · H[t0..t0+tw], reduction over this token chunk.
            let flags_w = chunk_flags(
                ti,
                token_chunks,
                [GEMM_ACC_LOAD, GEMM_ACC_STORE, GEMM_STORE_C],
            );
            gemm_launch(
                Layout::Tn,
                dtype,
                (&dz, dz_map()),
                (&h, h.map(t0, tw)),
                [vw, d, tw],
                GemmOut {
                    c: &d_weight,
                    acc: dw_acc.as_ref(),
                    bias: None,
                    flags: flags_w,
                    ldc: d,
                    c_offset: v0 * d,
                },
            );
        }
    }
    (d_hidden, d_weight, d_bias)
}
