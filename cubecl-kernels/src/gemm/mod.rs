//! Deterministic, row-invariant GEMM, row-reduction GEMM and column sums.

pub(crate) mod cmma;
pub(crate) mod cmma_async;
pub use cmma::CmmaTile;
pub(crate) mod col_sum;
pub(crate) mod fma;

use crate::consts::{
    CMMA_ASYNC_TILE, CMMA_FRAG, CMMA_TILE, CMMA_VECTOR, COL_SUM_BLOCK, FMA_BM, FMA_BN, FMA_THREADS,
};
use crate::error::KernelError;
use crate::util::{
    FloatDType, check_grid, check_out_view, check_runtime_dtype, check_view, expect_shape, raw_arg,
    to_u32,
};
use cubecl::features::MmaConfig;
use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::*;
use fma::{OperandLaunch, SKIP_NONE, SKIP_ZERO_RHS};

/// Which GEMM kernel runs for a given (dtype, K, N, device).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmPath {
    /// Scalar fused multiply-add chain: `acc = fma(a[i,k], b[k,j], acc)` for k ascending, f32.
    /// Tile 64×64×16 (see [`crate::consts`]).
    Fma,
    /// Cooperative-matrix (tensor core) kernel: fragments `frag_m×frag_n×frag_k` with f32
    /// accumulators, block `block_m×block_n`, K staged `block_k` deep, ascending.
    Cmma {
        /// Fragment m.
        frag_m: u32,
        /// Fragment n.
        frag_n: u32,
        /// Fragment k.
        frag_k: u32,
        /// Rows of output per cube.
        block_m: u32,
        /// Columns of output per cube.
        block_n: u32,
        /// K depth of one shared-memory stage.
        block_k: u32,
        /// Units per plane used at launch (the device's plane width).
        plane_size: u32,
        /// Fragments through `ldmatrix` and 16×8×16 `mma.sync` with per-lane registers (CUDA)
        /// instead of WMMA; the same MMA steps per output element, so the same bits.
        manual_mma: bool,
        /// The tiling of the `cp.async` kernel that runs instead where both operands are 16-byte
        /// vectors (CUDA), `None` where it never runs; same MMA steps per output element, so the
        /// same bits.
        async_tile: Option<CmmaTile>,
    },
}

impl core::fmt::Display for GemmPath {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            GemmPath::Fma => write!(
                f,
                "fma (f32 fused multiply-add chain, tile {FMA_BM}x{FMA_BN}x{}, k ascending)",
                crate::consts::FMA_BK
            ),
            GemmPath::Cmma {
                frag_m,
                frag_n,
                frag_k,
                block_m,
                block_n,
                block_k,
                plane_size,
                manual_mma,
                async_tile,
            } => {
                write!(
                    f,
                    "cmma (fragments {frag_m}x{frag_n}x{frag_k}{}, f32 accumulators, block \
                     {block_m}x{block_n}x{block_k}, plane {plane_size}, k ascending",
                    if *manual_mma {
                        " as ldmatrix + mma.sync 16x8x16"
                    } else {
                        ""
                    }
                )?;
                if let Some(t) = async_tile {
                    write!(
                        f,
                        "; where 16-byte aligned: block {}x{}x{}, planes {}x{}, cp.async ring of {}",
                        t.bm, t.bn, t.bk, t.pm, t.pn, t.stages
                    )?;
                }
                write!(f, ")")
            }
        }
    }
}

/// Whether the cooperative-matrix kernel can run for `dtype` on this client: the runtime must
/// advertise a 16×16×16 `dtype × dtype → f32` CMMA configuration and a fixed plane width.
pub fn cmma_supported<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> bool {
    let kind = match dtype {
        StorageType::Scalar(ElemType::Float(k @ (FloatKind::F16 | FloatKind::BF16))) => k,
        _ => return false,
    };
    let ab: StorageType = ElemType::Float(kind).into();
    let cfg = MmaConfig {
        a_type: ab,
        b_type: ab,
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: CMMA_FRAG as u32,
        n: CMMA_FRAG as u32,
        k: CMMA_FRAG as u32,
    };
    let hw = &client.properties().hardware;
    let plane = hw.plane_size_max;
    client.features().matmul.cmma.contains(&cfg)
        && hw.plane_size_min == hw.plane_size_max
        && (plane == 32 || plane == 64)
        && CMMA_TILE.is_valid(plane as usize)
        && (plane as usize * CMMA_TILE.planes()) <= hw.max_units_per_cube as usize
        && CMMA_TILE.shared_bytes(dtype.size()) <= hw.max_shared_memory_size
}

/// Whether the cmma kernel can drive the tensor cores by hand on this client: `ldmatrix` and
/// `mma.sync` 16×8×16 with CUDA's register layout (the CUDA runtime with that MMA advertised).
pub fn manual_mma_supported<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> bool {
    let cfg = MmaConfig {
        a_type: dtype,
        b_type: dtype,
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: CMMA_FRAG as u32,
        n: 8,
        k: CMMA_FRAG as u32,
    };
    R::name(client) == "cuda"
        && client.properties().hardware.plane_size_max == 32
        && client.features().matmul.mma.contains(&cfg)
}

/// The GEMM kernel [`matmul`] uses for (`dtype`, `k`, `n`) on this client.
///
/// The choice depends only on the dtype and the device capabilities (and is documented to
/// possibly depend on K and N in future versions), **never on M**: f32 → [`GemmPath::Fma`];
/// f16 / bf16 → [`GemmPath::Cmma`] where [`cmma_supported`], otherwise [`GemmPath::Fma`].
pub fn matmul_path<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    k: usize,
    n: usize,
) -> Result<GemmPath, KernelError> {
    let _ = (k, n);
    let dt = FloatDType::from_storage("dtype", dtype)?;
    check_runtime_dtype(client, "dtype", dt.storage())?;
    if dt != FloatDType::F32 && cmma_supported(client, dt.storage()) {
        let manual_mma = manual_mma_supported(client, dt.storage());
        Ok(GemmPath::Cmma {
            frag_m: CMMA_FRAG as u32,
            frag_n: CMMA_FRAG as u32,
            frag_k: CMMA_FRAG as u32,
            block_m: CMMA_TILE.bm as u32,
            block_n: CMMA_TILE.bn as u32,
            block_k: CMMA_TILE.bk as u32,
            plane_size: client.properties().hardware.plane_size_max,
            manual_mma,
            async_tile: async_tile(client, manual_mma, CMMA_ASYNC_TILE, dt.size()),
        })
    } else {
        Ok(GemmPath::Fma)
    }
}

/// How the f32 FMA path performs `fma(a, b, c)` on a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FmaMode {
    /// The device's `fma` instruction rounds once (CUDA, HIP, GPUs behind Vulkan/Metal).
    Fused,
    /// The device's `fma` rounds twice (lavapipe: WGSL `fma` becomes a multiply and an add), so
    /// the kernels build a once-rounded `fma` from error-free transformations (about 25 flops).
    Emulated,
}

/// The [`FmaMode`] of this client's device, probed once per device kind by one tiny kernel: with
/// `x = 1 + 2^-12`, `fma(x, x, -1)` is `2^-11 + 2^-24` rounded once and `2^-11` rounded twice.
/// The choice depends on the device only, never on shapes.
pub fn fma_mode<R: Runtime>(client: &ComputeClient<R>) -> FmaMode {
    use std::collections::HashMap;
    use std::hash::{Hash, Hasher};
    use std::sync::{Mutex, OnceLock};
    static MODES: OnceLock<Mutex<HashMap<(std::any::TypeId, u64), FmaMode>>> = OnceLock::new();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    client.properties().hardware.hash(&mut hasher);
    let key = (std::any::TypeId::of::<R>(), hasher.finish());
    let modes = MODES.get_or_init(Default::default);
    if let Some(mode) = modes.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return *mode;
    }
    let x = 1.0f32 + 2f32.powi(-12);
    let exact = 2f32.powi(-11) + 2f32.powi(-24);
    let input = client.create_from_slice(f32::as_bytes(&[x, x, -1.0]));
    let output = client.empty(4);
    unsafe {
        fma::fma_probe_kernel::launch::<R>(
            client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            ArrayArg::from_raw_parts(input, 3),
            ArrayArg::from_raw_parts(output.clone(), 1),
        )
    };
    let fused = client
        .read_one(output)
        .ok()
        .map(|bytes| f32::from_bytes(&bytes).first().copied() == Some(exact))
        .unwrap_or(false);
    let mode = if fused {
        FmaMode::Fused
    } else {
        FmaMode::Emulated
    };
    modes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, mode);
    mode
}

/// `fma(a[i], b[i], c[i])` by the emulation that [`FmaMode::Emulated`] devices use, for tests.
/// The three slices must have equal lengths. Only meaningful on a device whose compiler does not
/// contract `x·y + z` (CUDA does; there the device `fma` is used instead).
#[doc(hidden)]
pub fn fma_emulated_on_device<R: Runtime>(
    client: &ComputeClient<R>,
    a: &[f32],
    b: &[f32],
    c: &[f32],
) -> Result<Vec<f32>, KernelError> {
    let len = a.len();
    if b.len() != len || c.len() != len {
        return Err(KernelError::Shape {
            arg: "b, c",
            expected: format!("[{len}] (the length of a)"),
            got: vec![b.len(), c.len()],
        });
    }
    if len == 0 {
        return Ok(Vec::new());
    }
    let (gx, _) = check_grid(client, "a", len.div_ceil(256), 1)?;
    let upload = |x: &[f32]| client.create_from_slice(f32::as_bytes(x));
    let (ha, hb, hc) = (upload(a), upload(b), upload(c));
    let out = client.empty(len * 4);
    unsafe {
        fma::fma_emulated_kernel::launch::<R>(
            client,
            CubeCount::Static(gx, 1, 1),
            CubeDim::new_1d(256),
            ArrayArg::from_raw_parts(ha, len),
            ArrayArg::from_raw_parts(hb, len),
            ArrayArg::from_raw_parts(hc, len),
            ArrayArg::from_raw_parts(out.clone(), len),
        )
    };
    let bytes = client.read_one(out).map_err(|e| KernelError::Unsupported {
        what: "fma_emulated_on_device",
        reason: format!("read back failed: {e:?}"),
    })?;
    Ok(f32::from_bytes(&bytes).to_vec())
}

/// One operand as the FMA kernel sees it: buffer, dtype and layout.
pub(crate) struct Mat<'a, R: Runtime> {
    pub buf: &'a TensorBinding<R>,
    pub dtype: StorageType,
    pub offset: u32,
    pub s0: u32,
    pub s1: u32,
}

impl<'a, R: Runtime> Mat<'a, R> {
    /// A copy of this descriptor (same buffer reference).
    pub(crate) fn shallow(&self) -> Mat<'a, R> {
        Mat {
            buf: self.buf,
            dtype: self.dtype,
            offset: self.offset,
            s0: self.s0,
            s1: self.s1,
        }
    }

    fn launch(&self) -> OperandLaunch<R> {
        OperandLaunch::new(self.offset, self.s0, self.s1)
    }
}

/// The widest global load (in elements) the cmma kernel may use for `mat`, staged with its
/// contiguous (`inner`) dimension of extent `inner_ext`: [`CMMA_VECTOR`] where that dimension has
/// stride 1 and every vector start is 16-byte aligned and in-bounds, else 1. Only how bytes travel
/// depends on it, never the arithmetic.
fn cmma_vector<R: Runtime>(
    mat: &Mat<'_, R>,
    inner_stride: u32,
    outer_stride: u32,
    inner_ext: usize,
    elem_size: usize,
) -> usize {
    let w = CMMA_VECTOR;
    let base_aligned = mat
        .buf
        .handle
        .offset_start
        .unwrap_or(0)
        .is_multiple_of((w * elem_size) as u64);
    if inner_stride == 1
        && (outer_stride as usize).is_multiple_of(w)
        && inner_ext.is_multiple_of(w)
        && (mat.offset as usize).is_multiple_of(w)
        && base_aligned
    {
        w
    } else {
        1
    }
}

/// The launch scalars of the GEMM kernels: M, K, N in 32 bits, and the bias binding, offset and
/// stride (the rhs stands in, never read, when there is no bias).
type BiasArg<'a, R> = (&'a TensorBinding<R>, u32, u32);
fn gemm_scalars<'a, R: Runtime>(
    m: usize,
    k: usize,
    n: usize,
    rhs: &Mat<'a, R>,
    bias: Option<&Vec1<'a, R>>,
) -> Result<([u32; 3], BiasArg<'a, R>), KernelError> {
    let dims = [
        to_u32("lhs", "M", m)?,
        to_u32("lhs", "K", k)?,
        to_u32("rhs", "N", n)?,
    ];
    let bias = match bias {
        Some(b) => (b.buf, b.offset, b.stride),
        None => (rhs.buf, 0, 0),
    };
    Ok((dims, bias))
}

/// Launch the cmma kernel on explicit layouts (shapes already validated by the caller; f16/bf16).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_cmma<R: Runtime>(
    client: &ComputeClient<R>,
    lhs: &Mat<'_, R>,
    rhs: &Mat<'_, R>,
    bias: Option<&Vec1<'_, R>>,
    out: &Mat<'_, R>,
    m: usize,
    k: usize,
    n: usize,
    plane_size: u32,
    tile: CmmaTile,
    manual_mma: bool,
    async_tile: Option<CmmaTile>,
) -> Result<(), KernelError> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let ([m32, k32, n32], (bias_buf, bias_off, bias_stride)) = gemm_scalars(m, k, n, rhs, bias)?;
    let elem = lhs.dtype.size();
    // Each operand is staged with its smaller stride as the contiguous dimension.
    let a_kfast = lhs.s1 <= lhs.s0;
    let b_nfast = rhs.s1 <= rhs.s0;
    let va = if a_kfast {
        cmma_vector(lhs, lhs.s1, lhs.s0, k, elem)
    } else {
        cmma_vector(lhs, lhs.s0, lhs.s1, m, elem)
    };
    let vb = if b_nfast {
        cmma_vector(rhs, rhs.s1, rhs.s0, n, elem)
    } else {
        cmma_vector(rhs, rhs.s0, rhs.s1, k, elem)
    };
    // The ring kernel where both operands travel as 16-byte vectors; same bits either way.
    let ring = async_tile.filter(|_| va == CMMA_VECTOR && vb == CMMA_VECTOR);
    let tile = ring.unwrap_or(tile);
    let (gx, gy) = check_grid(client, "out", m.div_ceil(tile.bm), n.div_ceil(tile.bn))?;
    let threads = plane_size as usize * tile.planes();
    unsafe {
        cmma::gemm_cmma_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, gy, 1),
            CubeDim::new_2d(plane_size, tile.planes() as u32),
            va,
            vb,
            raw_arg(lhs.buf),
            lhs.launch(),
            raw_arg(rhs.buf),
            rhs.launch(),
            raw_arg(bias_buf),
            bias_off,
            bias_stride,
            raw_arg(out.buf),
            out.launch(),
            m32,
            k32,
            n32,
            bias.is_some(),
            a_kfast,
            b_nfast,
            threads,
            tile,
            manual_mma,
            ring.is_some(),
            lhs.dtype,
        );
    }
    Ok(())
}

/// `tile` where the `cp.async` kernel can run with it here: manual MMAs, the runtime has
/// `cp.async`, and the tiling is well formed and fits the cube and shared-memory limits. Where it
/// cannot, the register-pipelined kernel runs (same bits).
fn async_tile<R: Runtime>(
    client: &ComputeClient<R>,
    manual_mma: bool,
    tile: CmmaTile,
    elem: usize,
) -> Option<CmmaTile> {
    let hw = &client.properties().hardware;
    let plane = hw.plane_size_max as usize;
    (manual_mma
        && tile.ring_is_valid()
        && client.properties().features.copy_async
        && tile.is_valid(plane)
        && plane * tile.planes() <= hw.max_units_per_cube as usize
        && tile.async_shared_bytes(elem) <= hw.max_shared_memory_size)
        .then_some(tile)
}

/// Bias vector: buffer, offset, stride (same dtype as the rhs).
pub(crate) struct Vec1<'a, R: Runtime> {
    pub buf: &'a TensorBinding<R>,
    pub offset: u32,
    pub stride: u32,
}

/// Launch the FMA kernel on explicit layouts (shapes already validated by the caller).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_fma<R: Runtime>(
    client: &ComputeClient<R>,
    lhs: &Mat<'_, R>,
    rhs: &Mat<'_, R>,
    bias: Option<&Vec1<'_, R>>,
    out: &Mat<'_, R>,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
    skip_zero: u32,
) -> Result<(), KernelError> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let (gx, gy) = check_grid(client, "out", m.div_ceil(FMA_BM), n.div_ceil(FMA_BN))?;
    let ([m32, k32, n32], (bias_buf, bias_off, bias_stride)) = gemm_scalars(m, k, n, rhs, bias)?;
    unsafe {
        fma::gemm_fma_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, gy, 1),
            CubeDim::new_2d(FMA_THREADS as u32, FMA_THREADS as u32),
            raw_arg(lhs.buf),
            lhs.launch(),
            raw_arg(rhs.buf),
            rhs.launch(),
            raw_arg(bias_buf),
            bias_off,
            bias_stride,
            raw_arg(out.buf),
            out.launch(),
            m32,
            k32,
            n32,
            bias.is_some(),
            accumulate,
            skip_zero,
            fma_mode(client) == FmaMode::Emulated,
            [lhs.dtype, rhs.dtype, out.dtype],
        );
    }
    Ok(())
}

struct Checked {
    dt: FloatDType,
    m: usize,
    k: usize,
    n: usize,
}

fn check_gemm<R: Runtime>(
    client: &ComputeClient<R>,
    lhs: &TensorBinding<R>,
    rhs: &TensorBinding<R>,
    bias: Option<&TensorBinding<R>>,
    out: &TensorBinding<R>,
    dtype: StorageType,
) -> Result<(Checked, [crate::util::View; 3], Option<crate::util::View>), KernelError> {
    let dt = FloatDType::from_storage("dtype", dtype)?;
    check_runtime_dtype(client, "dtype", dt.storage())?;
    let es = dt.size();
    let lv = check_view("lhs", lhs, 2, es)?;
    let rv = check_view("rhs", rhs, 2, es)?;
    let ov = check_out_view("out", out, 2, es)?;
    let (m, k) = (lv.dim(0), lv.dim(1));
    if rv.dim(0) != k {
        return Err(KernelError::Shape {
            arg: "rhs",
            expected: format!("[{k}, N] (rows = lhs columns)"),
            got: rv.shape.clone(),
        });
    }
    let n = rv.dim(1);
    expect_shape("out", &ov, &[m, n])?;
    let bv = match bias {
        Some(b) => {
            let bv = check_view("bias", b, 1, es)?;
            expect_shape("bias", &bv, &[n])?;
            Some(bv)
        }
        None => None,
    };
    Ok((Checked { dt, m, k, n }, [lv, rv, ov], bv))
}

/// `out = lhs · rhs (+ bias)`, row-invariant and deterministic.
///
/// * `lhs` `[M, K]`, `rhs` `[K, N]`, `bias` `[N]`, `out` `[M, N]`: any strides (transposed views
///   included; `out` must not self-alias), all of dtype `dtype` (f32 / f16 / bf16).
/// * Accumulation in f32; bias added in f32; one final rounding to `dtype`.
/// * The kernel is chosen by [`matmul_path`] (never by M). Returns the path that ran.
pub fn matmul<R: Runtime>(
    client: &ComputeClient<R>,
    lhs: &TensorBinding<R>,
    rhs: &TensorBinding<R>,
    bias: Option<&TensorBinding<R>>,
    out: &TensorBinding<R>,
    dtype: StorageType,
) -> Result<GemmPath, KernelError> {
    let (c, [lv, rv, ov], bv) = check_gemm(client, lhs, rhs, bias, out, dtype)?;
    let path = matmul_path(client, dtype, c.k, c.n)?;
    let st = c.dt.storage();
    let lm = Mat {
        buf: lhs,
        dtype: st,
        offset: 0,
        s0: lv.stride(0) as u32,
        s1: lv.stride(1) as u32,
    };
    let rm = Mat {
        buf: rhs,
        dtype: st,
        offset: 0,
        s0: rv.stride(0) as u32,
        s1: rv.stride(1) as u32,
    };
    let om = Mat {
        buf: out,
        dtype: st,
        offset: 0,
        s0: ov.stride(0) as u32,
        s1: ov.stride(1) as u32,
    };
    let bm = match (bias, &bv) {
        (Some(b), Some(bv)) => Some(Vec1 {
            buf: b,
            offset: 0,
            stride: bv.stride(0) as u32,
        }),
        _ => None,
    };
    match path {
        GemmPath::Fma => launch_fma(
            client,
            &lm,
            &rm,
            bm.as_ref(),
            &om,
            c.m,
            c.k,
            c.n,
            false,
            SKIP_NONE,
        )?,
        GemmPath::Cmma {
            plane_size,
            manual_mma,
            async_tile,
            ..
        } => launch_cmma(
            client,
            &lm,
            &rm,
            bm.as_ref(),
            &om,
            c.m,
            c.k,
            c.n,
            plane_size,
            CMMA_TILE,
            manual_mma,
            async_tile,
        )?,
    }
    Ok(path)
}

/// [`matmul`] with an explicit cmma tiling instead of the pinned [`crate::consts::CMMA_TILE`] /
/// [`crate::consts::CMMA_ASYNC_TILE`], for tuning benchmarks: `tile` runs on the `cp.async`
/// kernel where that kernel runs (manual MMAs on CUDA, 16-byte aligned operands), else on the
/// register-pipelined one. Every tiling gives the same bits as the pinned ones (same MMA steps in
/// the same K order); only speed differs. Errors where the cmma path does not run for `dtype` or
/// the tiling does not fit the device.
#[doc(hidden)]
pub fn matmul_cmma_tiled<R: Runtime>(
    client: &ComputeClient<R>,
    lhs: &TensorBinding<R>,
    rhs: &TensorBinding<R>,
    out: &TensorBinding<R>,
    dtype: StorageType,
    tile: CmmaTile,
    manual_mma: bool,
) -> Result<(), KernelError> {
    let (c, [lv, rv, ov], _) = check_gemm(client, lhs, rhs, None, out, dtype)?;
    let GemmPath::Cmma { plane_size, .. } = matmul_path(client, dtype, c.k, c.n)? else {
        return Err(KernelError::Unsupported {
            what: "matmul_cmma_tiled",
            reason: "the cmma path does not run for this dtype on this device".into(),
        });
    };
    let hw = &client.properties().hardware;
    if manual_mma && !manual_mma_supported(client, dtype) {
        return Err(KernelError::Unsupported {
            what: "matmul_cmma_tiled",
            reason: "no ldmatrix + mma.sync 16x8x16 here".into(),
        });
    }
    if !tile.is_valid(plane_size as usize)
        || plane_size as usize * tile.planes() > hw.max_units_per_cube as usize
        || tile.shared_bytes(c.dt.size()) > hw.max_shared_memory_size
    {
        return Err(KernelError::Unsupported {
            what: "matmul_cmma_tiled",
            reason: format!("tiling {tile:?} does not fit this device"),
        });
    }
    let st = c.dt.storage();
    let mat = |buf, v: &crate::util::View| Mat {
        buf,
        dtype: st,
        offset: 0,
        s0: v.stride(0) as u32,
        s1: v.stride(1) as u32,
    };
    launch_cmma(
        client,
        &mat(lhs, &lv),
        &mat(rhs, &rv),
        None,
        &mat(out, &ov),
        c.m,
        c.k,
        c.n,
        plane_size,
        tile,
        manual_mma,
        async_tile(client, manual_mma, tile, c.dt.size()),
    )
}

/// The row-reduction product `out = lhs_t · dout`, for `dRhs = lhsᵀ · dOut`.
///
/// * `lhs_t` `[K, M]` is the transposed view of the forward lhs (pass strides `(1, K)` for a
///   row-major `[M, K]` lhs — no copy), `dout` `[M, N]`, `out` `[K, N]`; one dtype.
/// * Always the FMA kernel: `acc = fma(lhs[m,k], dout[m,n], acc)` for `m` ascending, walked in
///   fixed 16-row stages (a constant, independent of M), f32, one final rounding. No split-K, no
///   atomics, run-to-run deterministic.
/// * Terms whose `dout` element is exactly zero are **skipped**, so appending rows whose `dOut`
///   is zero leaves `out` bitwise unchanged — even when those rows of `lhs` hold NaN/Inf, and
///   including the sign of zero. (This is the only difference from [`matmul`]'s arithmetic.)
pub fn matmul_row_reduction<R: Runtime>(
    client: &ComputeClient<R>,
    lhs_t: &TensorBinding<R>,
    dout: &TensorBinding<R>,
    out: &TensorBinding<R>,
    dtype: StorageType,
) -> Result<(), KernelError> {
    let (c, [lv, rv, ov], _) = check_gemm(client, lhs_t, dout, None, out, dtype)?;
    let st = c.dt.storage();
    launch_fma(
        client,
        &Mat {
            buf: lhs_t,
            dtype: st,
            offset: 0,
            s0: lv.stride(0) as u32,
            s1: lv.stride(1) as u32,
        },
        &Mat {
            buf: dout,
            dtype: st,
            offset: 0,
            s0: rv.stride(0) as u32,
            s1: rv.stride(1) as u32,
        },
        None,
        &Mat {
            buf: out,
            dtype: st,
            offset: 0,
            s0: ov.stride(0) as u32,
            s1: ov.stride(1) as u32,
        },
        c.m,
        c.k,
        c.n,
        false,
        SKIP_ZERO_RHS,
    )
}

/// Launch the column-sum kernel on explicit layouts.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_col_sum<R: Runtime>(
    client: &ComputeClient<R>,
    x: &Mat<'_, R>,
    out: &Vec1<'_, R>,
    out_dtype: StorageType,
    m: usize,
    n: usize,
    accumulate: bool,
) -> Result<(), KernelError> {
    if n == 0 {
        return Ok(());
    }
    let (gx, _) = check_grid(client, "out", n.div_ceil(COL_SUM_BLOCK), 1)?;
    unsafe {
        col_sum::col_sum_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, 1, 1),
            CubeDim::new_1d(COL_SUM_BLOCK as u32),
            raw_arg(x.buf),
            x.launch(),
            raw_arg(out.buf),
            out.offset,
            out.stride,
            to_u32("x", "M", m)?,
            to_u32("x", "N", n)?,
            accumulate,
            [x.dtype, out_dtype],
        );
    }
    Ok(())
}

/// Launch the 2-D cast kernel on explicit layouts.
pub(crate) fn launch_cast_2d<R: Runtime>(
    client: &ComputeClient<R>,
    x: &Mat<'_, R>,
    out: &Mat<'_, R>,
    m: usize,
    n: usize,
) -> Result<(), KernelError> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let max_y = client.properties().hardware.max_cube_count.1 as usize;
    let (gx, gy) = check_grid(client, "out", n.div_ceil(COL_SUM_BLOCK), m.min(max_y))?;
    unsafe {
        col_sum::cast_2d_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, gy, 1),
            CubeDim::new_1d(COL_SUM_BLOCK as u32),
            raw_arg(x.buf),
            x.launch(),
            raw_arg(out.buf),
            out.launch(),
            to_u32("x", "M", m)?,
            to_u32("x", "N", n)?,
            [x.dtype, out.dtype],
        );
    }
    Ok(())
}

/// `out[j] = Σ_i x[i, j]` (bias gradient): rows in ascending order, f32 accumulator starting at
/// +0.0, one final rounding to `dtype`. `x` `[M, N]` any strides, `out` `[N]`.
///
/// Because the accumulator starts at +0.0 and IEEE addition never produces −0.0 from it, adding
/// a zero is an exact no-op: appending rows of zeros leaves the result bitwise unchanged.
pub fn col_sum<R: Runtime>(
    client: &ComputeClient<R>,
    x: &TensorBinding<R>,
    out: &TensorBinding<R>,
    dtype: StorageType,
) -> Result<(), KernelError> {
    let dt = FloatDType::from_storage("dtype", dtype)?;
    check_runtime_dtype(client, "dtype", dt.storage())?;
    let xv = check_view("x", x, 2, dt.size())?;
    let ov = check_out_view("out", out, 1, dt.size())?;
    let (m, n) = (xv.dim(0), xv.dim(1));
    expect_shape("out", &ov, &[n])?;
    launch_col_sum(
        client,
        &Mat {
            buf: x,
            dtype: dt.storage(),
            offset: 0,
            s0: xv.stride(0) as u32,
            s1: xv.stride(1) as u32,
        },
        &Vec1 {
            buf: out,
            offset: 0,
            stride: ov.stride(0) as u32,
        },
        dt.storage(),
        m,
        n,
        false,
    )
}
