//! The FMA GEMM kernel: one fixed 64×64 output block per cube, 16×16 units, 4×4 outputs per
//! unit, K walked in ascending 16-deep shared-memory stages. Per output element the arithmetic
//! is exactly `acc = fma(f32(a[i,k]), f32(b[k,j]), acc)` for `k = 0, 1, .., K-1` starting from
//! `acc = +0.0` (or from the value already in `out` when accumulating), then `acc + f32(bias[j])`,
//! then one rounding cast to the output dtype. The last partial K stage is bounded by K (no
//! padded terms are ever added).

use crate::consts::{FMA_BK, FMA_BM, FMA_BN, FMA_MICRO, FMA_THREADS};
use cubecl::prelude::*;

/// No terms skipped.
pub(crate) const SKIP_NONE: u32 = 0;
/// Terms whose lhs element is exactly zero are skipped.
pub(crate) const SKIP_ZERO_LHS: u32 = 1;
/// Terms whose rhs element is exactly zero are skipped.
pub(crate) const SKIP_ZERO_RHS: u32 = 2;

/// Layout of one GEMM operand inside its buffer, in elements.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub(crate) struct Operand {
    pub offset: u32,
    /// Stride between consecutive rows of the logical matrix.
    pub s0: u32,
    /// Stride between consecutive columns of the logical matrix.
    pub s1: u32,
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
) {
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
    #[unroll]
    for r in 0..FMA_MICRO {
        #[unroll]
        for c in 0..FMA_MICRO {
            let i = r * FMA_MICRO + c;
            let prev = acc[i];
            let next = fma(av[r], bv[c], prev);
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
#[allow(clippy::too_many_arguments)]
pub(crate) fn fma_block<A: Float, B: Float>(
    lhs: &Tensor<A>,
    lo: &Operand,
    rhs: &Tensor<B>,
    ro: &Operand,
    m: usize,
    k: usize,
    n: usize,
    row0: usize,
    col0: usize,
    acc: &mut Array<f32>,
    #[comptime] skip_zero: u32,
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
        if kc >= FMA_BK {
            #[unroll]
            for kk in 0..FMA_BK {
                fma_micro_step(&a_s, &b_s, kk, ty, tx, acc, skip_zero);
            }
        } else {
            // Final partial stage: bounded by K, so no padded term is ever added.
            for kk in 0..kc {
                fma_micro_step(&a_s, &b_s, kk, ty, tx, acc, skip_zero);
            }
        }
        sync_cube();
    }
}

/// `out[i,j] (+)= Σ_k lhs[i,k]·rhs[k,j] (+ bias[j])`, all layouts explicit.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_fma_kernel<A: Float, B: Float, O: Float>(
    lhs: &Tensor<A>,
    lo: Operand,
    rhs: &Tensor<B>,
    ro: Operand,
    bias: &Tensor<B>,
    bias_off: u32,
    bias_stride: u32,
    out: &mut Tensor<O>,
    oo: Operand,
    m: u32,
    k: u32,
    n: u32,
    #[comptime] has_bias: bool,
    #[comptime] accumulate: bool,
    #[comptime] skip_zero: u32,
    #[define(A, B, O)] _dtypes: [StorageType; 3],
) {
    let m = m as usize;
    let k = k as usize;
    let n = n as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let row0 = CUBE_POS_X as usize * FMA_BM;
    let col0 = CUBE_POS_Y as usize * FMA_BN;
    let o_off = oo.offset as usize;
    let o_s0 = oo.s0 as usize;
    let o_s1 = oo.s1 as usize;

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
                    v = f32::cast_from(out[o_off + row * o_s0 + col * o_s1]);
                }
            }
            acc[r * FMA_MICRO + c] = v;
        }
    }

    fma_block::<A, B>(lhs, &lo, rhs, &ro, m, k, n, row0, col0, &mut acc, skip_zero);

    #[unroll]
    for r in 0..FMA_MICRO {
        let row = row0 + ty + r * FMA_THREADS;
        #[unroll]
        for c in 0..FMA_MICRO {
            let col = col0 + tx + c * FMA_THREADS;
            if row < m && col < n {
                let mut v = acc[r * FMA_MICRO + c];
                if comptime![has_bias] {
                    v += f32::cast_from(bias[bias_off as usize + col * bias_stride as usize]);
                }
                out[o_off + row * o_s0 + col * o_s1] = O::cast_from(v);
            }
        }
    }
}
