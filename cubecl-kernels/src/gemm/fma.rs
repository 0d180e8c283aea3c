//! The FMA GEMM kernel: one fixed 64×64 output block per cube, 16×16 units, 4×4 outputs per
//! unit, K walked in ascending 16-deep shared-memory stages. Per output element the arithmetic
//! is exactly `acc = fma(f32(a[i,k]), f32(b[k,j]), acc)` for `k = 0, 1, .., K-1` starting from
//! `acc = +0.0` (or from the value already in `out` when accumulating), then `acc + f32(bias[j])`,
//! then one rounding cast to the output dtype. The last partial K stage is bounded by K (no
//! padded terms are ever added).

use crate::consts::{FMA_BK, FMA_BM, FMA_BN, FMA_MICRO, FMA_THREADS};
use crate::error::KernelError;
use crate::gemm::args::{GemmOperands, gemm_scalars};
use crate::gemm::view::{
    MatArg, Mkn, MknLaunch, Operands, OperandsLaunch, StridedView, VecArgLaunch,
};
use crate::util::{check_grid, raw_arg};
use cubecl::prelude::*;

/// No terms skipped.
pub(crate) const SKIP_NONE: u32 = 0;
/// Terms whose lhs element is exactly zero are skipped.
pub(crate) const SKIP_ZERO_LHS: u32 = 1;
/// Terms whose rhs element is exactly zero are skipped.
pub(crate) const SKIP_ZERO_RHS: u32 = 2;

/// `x`, hidden from the optimizer: or-ed bitwise with a runtime zero, so a shader compiler that
/// treats float arithmetic as reassociable (Mesa's NIR does, for SPIR-V without `NoContraction`)
/// cannot rewrite the exact error terms below into the naive expression.
#[cube]
fn pinned(x: f32, zero: u32) -> f32 {
    f32::reinterpret(u32::reinterpret(x) | zero)
}

/// The high half of `x`'s significand (12 bits) as a float: `x - high(x)` is exact and also has
/// at most 12 significant bits, so products of halves are exact in f32 (Dekker).
#[cube]
fn high_half(x: f32) -> f32 {
    f32::reinterpret(u32::reinterpret(x) & 0xFFFF_F000u32)
}

/// `fma(a, b, c)` with one rounding, from separately rounded operations, for devices whose `fma`
/// is not fused (lavapipe). Boldo & Melquiond, "Emulation of FMA and correctly rounded sums:
/// proved algorithms using rounding to odd" (IEEE TC 2008): the product split exactly by Dekker
/// (`p + e = a·b`), the sum split exactly (`th + tl = c + p`), the two small terms added with
/// rounding to odd, then one rounding to nearest. Every intermediate is [`pinned`] against
/// algebraic rewriting. Bit-exact for operands of magnitude ≤ 2^100 whose nonzero product has
/// magnitude ≥ 2^-100 (no overflow, no underflow in the error terms); infinities and NaN follow
/// IEEE `fma`; other extreme magnitudes get `a·b + c` (two roundings). Launches must have one
/// cube along z (`CUBE_POS_Z` is the runtime zero).
#[cube]
pub(crate) fn fma_emulated(a: f32, b: f32, c: f32) -> f32 {
    let z = CUBE_POS_Z;
    let p = pinned(a * b, z);
    let ah = high_half(a);
    let al = pinned(a - ah, z);
    let bh = high_half(b);
    let bl = pinned(b - bh, z);
    let e1 = pinned(pinned(ah * bh, z) - p, z);
    let e2 = pinned(e1 + pinned(ah * bl, z), z);
    let e3 = pinned(e2 + pinned(al * bh, z), z);
    let e = pinned(e3 + pinned(al * bl, z), z);
    // th + tl = c + p exactly.
    let th = pinned(c + p, z);
    let tv = pinned(th - c, z);
    let tl = pinned(pinned(c - pinned(th - tv, z), z) + pinned(p - tv, z), z);
    // v = tl + e rounded to odd: round to nearest, then step one ulp toward the exact value
    // when that was inexact and landed on an even significand.
    let s = pinned(tl + e, z);
    let sv = pinned(s - tl, z);
    let err = pinned(pinned(tl - pinned(s - sv, z), z) + pinned(e - sv, z), z);
    let bits = u32::reinterpret(s);
    let away = (err > 0.0f32) == (s > 0.0f32);
    let stepped = f32::reinterpret(select(away, bits + 1, bits - 1));
    let v = select(err != 0.0f32 && (bits & 1) == 0, stepped, s);
    let emulated = select(v == 0.0f32, th, th + v);
    let big = 1.2676506e30f32; // 2^100
    let tiny = 7.888609e-31f32; // 2^-100
    let ap = p.abs();
    let in_range = a.abs() <= big
        && b.abs() <= big
        && c.abs() <= big
        && ap <= big
        && (ap >= tiny || a == 0.0f32 || b == 0.0f32);
    // Outside the range: IEEE `fma` semantics for infinities and NaN (an infinite `c` with finite
    // factors wins even where `a·b` would overflow).
    let max = 3.4028235e38f32; // f32::MAX
    let c_wins = c.abs() > max && a.abs() <= max && b.abs() <= max;
    select(in_range, emulated, select(c_wins, c, a * b + c))
}

/// `fma(a, b, c)`: the device instruction, or [`fma_emulated`] where it is not fused.
#[cube]
pub(crate) fn fma_f32(a: f32, b: f32, c: f32, #[comptime] emulate: bool) -> f32 {
    if comptime![emulate] {
        fma_emulated(a, b, c)
    } else {
        fma(a, b, c)
    }
}

#[cube]
fn fma_micro_step(
    a_s: &SharedMemory<f32>,
    b_s: &SharedMemory<f32>,
    kk: usize,
    ty: usize,
    tx: usize,
    acc: &mut Array<f32>,
    #[comptime] skip_zero: u32,
    #[comptime] emulate_fma: bool,
) {
    // The emulated fma is long: unrolled copies of it would only cost shader compile time.
    let unroll = comptime!(!emulate_fma);
    let mut av = Array::<f32>::new(FMA_MICRO);
    let mut bv = Array::<f32>::new(FMA_MICRO);
    #[unroll]
    for r in 0..FMA_MICRO {
        av[r] = a_s[(ty + r * FMA_THREADS) * FMA_BK + kk];
    }
    #[unroll]
    for c in 0..FMA_MICRO {
        bv[c] = b_s[kk * FMA_BN + tx + c * FMA_THREADS];
    }
    #[unroll(unroll)]
    for r in 0..FMA_MICRO {
        #[unroll(unroll)]
        for c in 0..FMA_MICRO {
            let i = r * FMA_MICRO + c;
            let prev = acc[i];
            let next = fma_f32(av[r], bv[c], prev, emulate_fma);
            if comptime![skip_zero == SKIP_ZERO_LHS] {
                acc[i] = select(av[r] == 0.0, prev, next);
            } else if comptime![skip_zero == SKIP_ZERO_RHS] {
                acc[i] = select(bv[c] == 0.0, prev, next);
            } else {
                acc[i] = next;
            }
        }
    }
}

/// Accumulate the 64×64 block at (`row0`, `col0`) of `lhs[m,k] · rhs[k,n]` into `acc`
/// (the caller's unit owns rows `row0 + ty + 16 r` and columns `col0 + tx + 16 c`).
/// Must be called by all 256 units of the cube (it synchronizes).
#[cube]
#[allow(clippy::too_many_arguments)] // #[cube] helpers take each tensor and index separately
pub(crate) fn fma_block<A: Float, B: Float>(
    lhs: &Tensor<A>,
    lo: &StridedView,
    rhs: &Tensor<B>,
    ro: &StridedView,
    m: usize,
    k: usize,
    n: usize,
    row0: usize,
    col0: usize,
    acc: &mut Array<f32>,
    #[comptime] skip_zero: u32,
    #[comptime] emulate_fma: bool,
) {
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let tid = ty * FMA_THREADS + tx;
    let nthreads = FMA_THREADS * FMA_THREADS;

    let mut a_s = SharedMemory::<f32>::new(FMA_BM * FMA_BK);
    let mut b_s = SharedMemory::<f32>::new(FMA_BK * FMA_BN);

    let la_off = lo.offset as usize;
    let la_s0 = lo.s0 as usize;
    let la_s1 = lo.s1 as usize;
    let lb_off = ro.offset as usize;
    let lb_s0 = ro.s0 as usize;
    let lb_s1 = ro.s1 as usize;
    // Pick the load mapping that makes consecutive units read consecutive addresses.
    let a_kfast = la_s1 <= la_s0;
    let b_nfast = lb_s1 <= lb_s0;

    let num_stages = k.div_ceil(FMA_BK);
    for stage in 0..num_stages {
        let k0 = stage * FMA_BK;
        #[unroll]
        for e in 0..(FMA_BM * FMA_BK / (FMA_THREADS * FMA_THREADS)) {
            let idx = tid + e * nthreads;
            let r = select(a_kfast, idx / FMA_BK, idx % FMA_BM);
            let kk = select(a_kfast, idx % FMA_BK, idx / FMA_BM);
            let row = row0 + r;
            let kg = k0 + kk;
            let mut v = 0.0f32;
            if row < m && kg < k {
                v = f32::cast_from(lhs[la_off + row * la_s0 + kg * la_s1]);
            }
            a_s[r * FMA_BK + kk] = v;
        }
        #[unroll]
        for e in 0..(FMA_BK * FMA_BN / (FMA_THREADS * FMA_THREADS)) {
            let idx = tid + e * nthreads;
            let kk = select(b_nfast, idx / FMA_BN, idx % FMA_BK);
            let c = select(b_nfast, idx % FMA_BN, idx / FMA_BK);
            let col = col0 + c;
            let kg = k0 + kk;
            let mut v = 0.0f32;
            if col < n && kg < k {
                v = f32::cast_from(rhs[lb_off + kg * lb_s0 + col * lb_s1]);
            }
            b_s[kk * FMA_BN + c] = v;
        }
        sync_cube();
        let kc = k - k0;
        if comptime![emulate_fma] {
            for kk in 0..min(kc, FMA_BK) {
                fma_micro_step(&a_s, &b_s, kk, ty, tx, acc, skip_zero, emulate_fma);
            }
        } else if kc >= FMA_BK {
            #[unroll]
            for kk in 0..FMA_BK {
                fma_micro_step(&a_s, &b_s, kk, ty, tx, acc, skip_zero, emulate_fma);
            }
        } else {
            // Final partial stage: bounded by K, so no padded term is ever added.
            for kk in 0..kc {
                fma_micro_step(&a_s, &b_s, kk, ty, tx, acc, skip_zero, emulate_fma);
            }
        }
        sync_cube();
    }
}

/// The FMA GEMM kernel's compile-time switches: a bias to add, accumulate into `out`, which
/// zero terms to skip (`SKIP_*`), `fma` emulated.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) struct FmaCfg {
    pub has_bias: bool,
    pub accumulate: bool,
    pub skip_zero: u32,
    pub emulate_fma: bool,
}

/// `out[i,j] (+)= Σ_k lhs[i,k]·rhs[k,j] (+ bias[j])`, all layouts explicit.
#[cube(launch_unchecked)]
pub(crate) fn gemm_fma_kernel<A: Float, B: Float, O: Float>(
    ab: &Operands<A, B>,
    out: &mut MatArg<O>,
    sizes: Mkn,
    #[comptime] cfg: FmaCfg,
    #[define(A, B, O)] _dtypes: [StorageType; 3],
) {
    let (has_bias, accumulate, skip_zero, emulate_fma) = (
        comptime![cfg.has_bias],
        comptime![cfg.accumulate],
        comptime![cfg.skip_zero],
        comptime![cfg.emulate_fma],
    );
    let m = sizes.m as usize;
    let k = sizes.k as usize;
    let n = sizes.n as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let row0 = CUBE_POS_X as usize * FMA_BM;
    let col0 = CUBE_POS_Y as usize * FMA_BN;
    let o_off = out.view.offset as usize;
    let o_s0 = out.view.s0 as usize;
    let o_s1 = out.view.s1 as usize;

    let mut acc = Array::<f32>::new(FMA_MICRO * FMA_MICRO);
    #[unroll]
    for r in 0..FMA_MICRO {
        #[unroll]
        for c in 0..FMA_MICRO {
            let mut v = 0.0f32;
            if comptime![accumulate] {
                let row = row0 + ty + r * FMA_THREADS;
                let col = col0 + tx + c * FMA_THREADS;
                if row < m && col < n {
                    v = f32::cast_from(out.buf[o_off + row * o_s0 + col * o_s1]);
                }
            }
            acc[r * FMA_MICRO + c] = v;
        }
    }

    fma_block::<A, B>(
        &ab.lhs.buf,
        &ab.lhs.view,
        &ab.rhs.buf,
        &ab.rhs.view,
        m,
        k,
        n,
        row0,
        col0,
        &mut acc,
        skip_zero,
        emulate_fma,
    );

    #[unroll]
    for r in 0..FMA_MICRO {
        let row = row0 + ty + r * FMA_THREADS;
        #[unroll]
        for c in 0..FMA_MICRO {
            let col = col0 + tx + c * FMA_THREADS;
            if row < m && col < n {
                let mut v = acc[r * FMA_MICRO + c];
                if comptime![has_bias] {
                    v += f32::cast_from(
                        ab.bias.buf[ab.bias.offset as usize + col * ab.bias.stride as usize],
                    );
                }
                out.buf[o_off + row * o_s0 + col * o_s1] = O::cast_from(v);
            }
        }
    }
}

/// One device `fma(x[0], x[1], x[2])`, read from memory so no compiler can fold it.
#[cube(launch)]
pub(crate) fn fma_probe_kernel(x: &Array<f32>, out: &mut Array<f32>) {
    if UNIT_POS == 0 {
        out[0] = fma(x[0], x[1], x[2]);
    }
}

/// `out[i] = fma_emulated(a[i], b[i], c[i])`, for testing the emulation against a CPU `mul_add`.
#[cube(launch)]
pub(crate) fn fma_emulated_kernel(
    a: &Array<f32>,
    b: &Array<f32>,
    c: &Array<f32>,
    out: &mut Array<f32>,
) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        out[i] = fma_emulated(a[i], b[i], c[i]);
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
        fma_probe_kernel::launch::<R>(
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
        fma_emulated_kernel::launch::<R>(
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

/// Launch the FMA kernel on explicit layouts (shapes already validated by the caller), in as
/// many output blocks as the runtime's cube count needs.
pub(crate) fn launch_fma<R: Runtime>(
    client: &ComputeClient<R>,
    ops: &GemmOperands<'_, R>,
    [m, k, n]: [usize; 3],
    accumulate: bool,
    skip_zero: u32,
) -> Result<(), KernelError> {
    ops.for_blocks(client, [m, n], [FMA_BM, FMA_BN], |block, rows, cols| {
        launch_fma_grid(client, block, [rows, k, cols], accumulate, skip_zero)
    })
}

/// One launch of the FMA kernel.
fn launch_fma_grid<R: Runtime>(
    client: &ComputeClient<R>,
    ops: &GemmOperands<'_, R>,
    [m, k, n]: [usize; 3],
    accumulate: bool,
    skip_zero: u32,
) -> Result<(), KernelError> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let GemmOperands {
        lhs,
        rhs,
        bias,
        out,
    } = ops;
    let (gx, gy) = check_grid(client, "out", m.div_ceil(FMA_BM), n.div_ceil(FMA_BN))?;
    let ([m, k, n], (bias_buf, bias_off, bias_stride)) = gemm_scalars(m, k, n, rhs, bias.as_ref())?;
    let cfg = FmaCfg {
        has_bias: bias.is_some(),
        accumulate,
        skip_zero,
        emulate_fma: fma_mode(client) == FmaMode::Emulated,
    };
    unsafe {
        gemm_fma_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, gy, 1),
            CubeDim::new_2d(FMA_THREADS as u32, FMA_THREADS as u32),
            OperandsLaunch::new(
                lhs.arg(),
                rhs.arg(),
                VecArgLaunch::new(raw_arg(bias_buf), bias_off, bias_stride),
            ),
            out.arg(),
            MknLaunch::new(m, k, n),
            cfg,
            [lhs.dtype, rhs.dtype, out.dtype],
        );
    }
    Ok(())
}
