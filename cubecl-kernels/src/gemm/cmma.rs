//! The cooperative-matrix (tensor core) GEMM for f16 / bf16 inputs.
//!
//! Pinned shape: a 64×64 output block per cube, 4 planes in a 2×2 arrangement (each plane owns a
//! 32×32 sub-block = 2×2 fragments of 16×16×16), K staged through shared memory in 32-deep stages
//! (two MMA steps each), walked in one fixed ascending order. Accumulators are f32. Operands are
//! converted to the fragment dtype when staged (they are already in it); positions outside
//! [M)×[K) / [K)×[N) are staged as zeros, which only ever meet other zeros or in-range values of
//! the same output element, so the padding depends on K and N, never on M. The result is staged
//! through shared memory, the bias is added in f32, and the value is rounded once to the output
//! dtype.

use crate::consts::{CMMA_BK, CMMA_BM, CMMA_BN, CMMA_FRAG};
use crate::gemm::fma::Operand;
use cubecl::prelude::*;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_cmma_kernel<F: Float>(
    lhs: &Tensor<F>,
    lo: Operand,
    rhs: &Tensor<F>,
    ro: Operand,
    bias: &Tensor<F>,
    bias_off: u32,
    bias_stride: u32,
    out: &mut Tensor<F>,
    oo: Operand,
    m: u32,
    k: u32,
    n: u32,
    #[comptime] has_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let m = m as usize;
    let k = k as usize;
    let n = n as usize;
    let row0 = CUBE_POS_X as usize * CMMA_BM;
    let col0 = CUBE_POS_Y as usize * CMMA_BN;
    let plane = UNIT_POS_Y as usize;
    let tid = UNIT_POS as usize;
    let nthreads = (CUBE_DIM_X * CUBE_DIM_Y) as usize;
    let pr = plane / 2;
    let pc = plane % 2;

    let la_off = lo.offset as usize;
    let la_s0 = lo.s0 as usize;
    let la_s1 = lo.s1 as usize;
    let lb_off = ro.offset as usize;
    let lb_s0 = ro.s0 as usize;
    let lb_s1 = ro.s1 as usize;
    let a_kfast = la_s1 <= la_s0;
    let b_nfast = lb_s1 <= lb_s0;

    let mut a_s = SharedMemory::<F>::new_aligned(CMMA_BM * CMMA_BK, 64usize);
    let mut b_s = SharedMemory::<F>::new_aligned(CMMA_BK * CMMA_BN, 64usize);
    let mut c_s = SharedMemory::<f32>::new_aligned(CMMA_BM * CMMA_BN, 64usize);

    let c00 = cmma::Matrix::<f32>::from_value(
        cmma::MatrixIdent::Accumulator,
        CMMA_FRAG,
        CMMA_FRAG,
        CMMA_FRAG,
        cmma::MatrixLayout::Undefined,
        0.0,
    );
    let c01 = cmma::Matrix::<f32>::from_value(
        cmma::MatrixIdent::Accumulator,
        CMMA_FRAG,
        CMMA_FRAG,
        CMMA_FRAG,
        cmma::MatrixLayout::Undefined,
        0.0,
    );
    let c10 = cmma::Matrix::<f32>::from_value(
        cmma::MatrixIdent::Accumulator,
        CMMA_FRAG,
        CMMA_FRAG,
        CMMA_FRAG,
        cmma::MatrixLayout::Undefined,
        0.0,
    );
    let c11 = cmma::Matrix::<f32>::from_value(
        cmma::MatrixIdent::Accumulator,
        CMMA_FRAG,
        CMMA_FRAG,
        CMMA_FRAG,
        cmma::MatrixLayout::Undefined,
        0.0,
    );
    let a0 = unsafe {
        cmma::Matrix::<F>::uninitialized(
            cmma::MatrixIdent::A,
            CMMA_FRAG,
            CMMA_FRAG,
            CMMA_FRAG,
            cmma::MatrixLayout::RowMajor,
        )
    };
    let a1 = unsafe {
        cmma::Matrix::<F>::uninitialized(
            cmma::MatrixIdent::A,
            CMMA_FRAG,
            CMMA_FRAG,
            CMMA_FRAG,
            cmma::MatrixLayout::RowMajor,
        )
    };
    let b0 = unsafe {
        cmma::Matrix::<F>::uninitialized(
            cmma::MatrixIdent::B,
            CMMA_FRAG,
            CMMA_FRAG,
            CMMA_FRAG,
            cmma::MatrixLayout::RowMajor,
        )
    };
    let b1 = unsafe {
        cmma::Matrix::<F>::uninitialized(
            cmma::MatrixIdent::B,
            CMMA_FRAG,
            CMMA_FRAG,
            CMMA_FRAG,
            cmma::MatrixLayout::RowMajor,
        )
    };

    let per_a = (CMMA_BM * CMMA_BK) / nthreads;
    let per_b = (CMMA_BK * CMMA_BN) / nthreads;
    let num_stages = k.div_ceil(CMMA_BK);
    for stage in 0..num_stages {
        let k0 = stage * CMMA_BK;
        for e in 0..per_a {
            let idx = tid + e * nthreads;
            let r = select(a_kfast, idx / CMMA_BK, idx % CMMA_BM);
            let kk = select(a_kfast, idx % CMMA_BK, idx / CMMA_BM);
            let row = row0 + r;
            let kg = k0 + kk;
            let mut v = F::new(0.0);
            if row < m && kg < k {
                v = lhs[la_off + row * la_s0 + kg * la_s1];
            }
            a_s[r * CMMA_BK + kk] = v;
        }
        for e in 0..per_b {
            let idx = tid + e * nthreads;
            let kk = select(b_nfast, idx / CMMA_BN, idx % CMMA_BK);
            let c = select(b_nfast, idx % CMMA_BN, idx / CMMA_BK);
            let col = col0 + c;
            let kg = k0 + kk;
            let mut v = F::new(0.0);
            if col < n && kg < k {
                v = rhs[lb_off + kg * lb_s0 + col * lb_s1];
            }
            b_s[kk * CMMA_BN + c] = v;
        }
        sync_cube();
        #[unroll]
        for s in 0..(CMMA_BK / CMMA_FRAG) {
            let a_base = (pr * 32) * CMMA_BK + s * CMMA_FRAG;
            let a_len = (CMMA_FRAG - 1) * CMMA_BK + CMMA_FRAG;
            cmma::load(&a0, &a_s.slice(a_base, a_base + a_len), CMMA_BK as u32);
            let a_base1 = a_base + CMMA_FRAG * CMMA_BK;
            cmma::load(&a1, &a_s.slice(a_base1, a_base1 + a_len), CMMA_BK as u32);
            let b_base = (s * CMMA_FRAG) * CMMA_BN + pc * 32;
            let b_len = (CMMA_FRAG - 1) * CMMA_BN + CMMA_FRAG;
            cmma::load(&b0, &b_s.slice(b_base, b_base + b_len), CMMA_BN as u32);
            let b_base1 = b_base + CMMA_FRAG;
            cmma::load(&b1, &b_s.slice(b_base1, b_base1 + b_len), CMMA_BN as u32);
            cmma::execute::<F, F, f32, f32>(&a0, &b0, &c00, &c00);
            cmma::execute::<F, F, f32, f32>(&a0, &b1, &c01, &c01);
            cmma::execute::<F, F, f32, f32>(&a1, &b0, &c10, &c10);
            cmma::execute::<F, F, f32, f32>(&a1, &b1, &c11, &c11);
        }
        sync_cube();
    }

    let c_base = (pr * 32) * CMMA_BN + pc * 32;
    let c_len = (CMMA_FRAG - 1) * CMMA_BN + CMMA_FRAG;
    cmma::store(
        &mut c_s.slice_mut(c_base, c_base + c_len),
        &c00,
        CMMA_BN as u32,
        cmma::MatrixLayout::RowMajor,
    );
    let c_base01 = c_base + CMMA_FRAG;
    cmma::store(
        &mut c_s.slice_mut(c_base01, c_base01 + c_len),
        &c01,
        CMMA_BN as u32,
        cmma::MatrixLayout::RowMajor,
    );
    let c_base10 = c_base + CMMA_FRAG * CMMA_BN;
    cmma::store(
        &mut c_s.slice_mut(c_base10, c_base10 + c_len),
        &c10,
        CMMA_BN as u32,
        cmma::MatrixLayout::RowMajor,
    );
    let c_base11 = c_base10 + CMMA_FRAG;
    cmma::store(
        &mut c_s.slice_mut(c_base11, c_base11 + c_len),
        &c11,
        CMMA_BN as u32,
        cmma::MatrixLayout::RowMajor,
    );
    sync_cube();

    let o_off = oo.offset as usize;
    let o_s0 = oo.s0 as usize;
    let o_s1 = oo.s1 as usize;
    let per_c = (CMMA_BM * CMMA_BN) / nthreads;
    for e in 0..per_c {
        let idx = tid + e * nthreads;
        let r = idx / CMMA_BN;
        let c = idx % CMMA_BN;
        let row = row0 + r;
        let col = col0 + c;
        if row < m && col < n {
            let mut v = c_s[idx];
            if comptime![has_bias] {
                v += f32::cast_from(bias[bias_off as usize + col * bias_stride as usize]);
            }
            out[o_off + row * o_s0 + col * o_s1] = F::cast_from(v);
        }
    }
}
