//! The register-pipelined body of the cmma GEMM (every runtime with cooperative matrices, and
//! CUDA where an operand is not 16-byte aligned): two shared stages, the next stage's global
//! loads issued into registers before the current stage's MMAs, one cube barrier per stage.
// #[cube] functions take each tensor, shared memory and index as its own argument (they are
// expanded inline); the comptime choices travel together in `CmmaConfig`.
#![allow(clippy::too_many_arguments)]

use super::config::CmmaConfig;
use super::fragment::{
    Block, fetch_tile, mma_stage_manual, mma_stage_wmma, operand_tiles, stash_stage, store_manual,
    store_wmma, this_block, wmma_accumulators, wmma_operands, zero_manual_accumulators,
};
use crate::consts::{CMMA_FRAG, CmmaTile, stage_len};
use crate::gemm::view::StridedView;
use cubecl::prelude::*;

/// The register-pipelined body of `gemm_cmma_kernel`.
#[cube]
pub(crate) fn gemm_registers<F: Float, O: Float, VA: Size, VB: Size>(
    lhs: &Tensor<Vector<F, VA>>,
    lo: &StridedView,
    rhs: &Tensor<Vector<F, VB>>,
    ro: &StridedView,
    bias: &Tensor<F>,
    bias_off: u32,
    bias_stride: u32,
    out: &mut Tensor<O>,
    oo: &StridedView,
    m: u32,
    k: u32,
    n: u32,
    #[comptime] cfg: CmmaConfig,
) {
    let tile = comptime!(cfg.tile);
    let block = this_block(m, k, n, cfg);
    let plane = UNIT_POS_Y as usize;
    let prow = (plane / comptime!(tile.pn)) * comptime!(tile.bm / tile.pm);
    let pcol = (plane % comptime!(tile.pn)) * comptime!(tile.bn / tile.pn);
    let (a_outer, a_inner, b_outer, b_inner) = comptime!(operand_tiles(cfg));
    let va = VA::value().comptime();
    let vb = VB::value().comptime();
    let a_stage = comptime!(stage_len(a_outer, a_inner) / va);
    let b_stage = comptime!(stage_len(b_outer, b_inner) / vb);
    let a_regs_len = comptime!(a_outer * a_inner / va / cfg.threads);
    let b_regs_len = comptime!(b_outer * b_inner / vb / cfg.threads);

    let mut a_s = SharedMemory::<Vector<F, VA>>::new_aligned(comptime!(2 * a_stage), 16usize);
    let mut b_s = SharedMemory::<Vector<F, VB>>::new_aligned(comptime!(2 * b_stage), 16usize);
    let c_len = comptime!(tile.pm * tile.pn * CMMA_FRAG * CMMA_FRAG);
    let mut c_s = SharedMemory::<f32>::new_aligned(c_len, 16usize);
    let mut a_regs = Array::<Vector<F, VA>>::new(a_regs_len);
    let mut b_regs = Array::<Vector<F, VB>>::new(b_regs_len);

    // Fragments: per-lane registers of 16×8×16 MMAs on the manual path, WMMA 16×16 matrices
    // elsewhere (each kind is empty on the other path).
    let mut regs_c = zero_manual_accumulators(cfg);
    let mut accs = wmma_accumulators(cfg);
    let mut a_frags = wmma_operands::<F>(cfg, true);
    let mut b_frags = wmma_operands::<F>(cfg, false);

    stage_loop::<F, VA, VB>(
        lhs,
        lo,
        rhs,
        ro,
        &mut a_s,
        &mut b_s,
        &mut a_regs,
        &mut b_regs,
        &mut regs_c,
        &mut accs,
        &mut a_frags,
        &mut b_frags,
        &block,
        prow,
        pcol,
        cfg,
    );

    let (row0, col0) = (block.row0 + prow, block.col0 + pcol);
    let (m, n) = (block.m, block.n);
    if comptime![cfg.manual] {
        store_manual::<F, O>(
            &regs_c,
            bias,
            bias_off,
            bias_stride,
            out,
            oo,
            row0,
            col0,
            m,
            n,
            cfg,
        );
    } else {
        let scratch = plane * CMMA_FRAG * CMMA_FRAG;
        let c_s = &mut c_s;
        store_wmma::<F, O>(
            &accs,
            c_s,
            scratch,
            bias,
            bias_off,
            bias_stride,
            out,
            oo,
            row0,
            col0,
            m,
            n,
            cfg,
        );
    }
}

/// The K stages: the next stage's global loads into registers, the current stage's MMAs, then
/// the registers into the other shared buffer, one cube barrier per stage.
#[cube]
fn stage_loop<F: Float, VA: Size, VB: Size>(
    lhs: &Tensor<Vector<F, VA>>,
    lo: &StridedView,
    rhs: &Tensor<Vector<F, VB>>,
    ro: &StridedView,
    a_s: &mut SharedMemory<Vector<F, VA>>,
    b_s: &mut SharedMemory<Vector<F, VB>>,
    a_regs: &mut Array<Vector<F, VA>>,
    b_regs: &mut Array<Vector<F, VB>>,
    regs_c: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    accs: &mut Sequence<cmma::Matrix<f32>>,
    a_frags: &mut Sequence<cmma::Matrix<F>>,
    b_frags: &mut Sequence<cmma::Matrix<F>>,
    block: &Block,
    prow: usize,
    pcol: usize,
    #[comptime] cfg: CmmaConfig,
) {
    let (a_outer, a_inner, b_outer, b_inner) = comptime!(operand_tiles(cfg));
    let va = VA::value().comptime();
    let vb = VB::value().comptime();
    let a_stage = comptime!(stage_len(a_outer, a_inner) / va);
    let b_stage = comptime!(stage_len(b_outer, b_inner) / vb);
    let bk = comptime!(cfg.tile.bk);
    let num_stages = block.k.div_ceil(bk);
    // Prologue: stage 0 into buffer 0.
    fetch_stage::<F, VA, VB>(lhs, rhs, a_regs, b_regs, lo, ro, block, 0, cfg);
    stash_stage::<F, VA, VB>(a_regs, b_regs, a_s, b_s, 0, block.tid, cfg);
    sync_cube();
    for stage in 0..num_stages {
        let cur = stage % 2;
        let has_next = stage + 1 < num_stages;
        if has_next {
            let k_next = (stage + 1) * bk;
            fetch_stage::<F, VA, VB>(lhs, rhs, a_regs, b_regs, lo, ro, block, k_next, cfg);
        }
        let (a_base, b_base) = (cur * a_stage, cur * b_stage);
        if comptime![cfg.manual] {
            mma_stage_manual::<F, VA, VB>(a_s, b_s, a_base, b_base, regs_c, prow, pcol, cfg);
        } else {
            mma_stage_wmma::<F, VA, VB>(
                a_s, b_s, a_base, b_base, accs, a_frags, b_frags, prow, pcol, cfg,
            );
        }
        if has_next {
            stash_stage::<F, VA, VB>(a_regs, b_regs, a_s, b_s, 1 - cur, block.tid, cfg);
        }
        sync_cube();
    }
}

/// Both operands' tiles of the stage at K origin `k0` into registers. Each operand is read with
/// its contiguous dimension as the tile's inner one.
#[cube]
fn fetch_stage<F: Float, VA: Size, VB: Size>(
    lhs: &Tensor<Vector<F, VA>>,
    rhs: &Tensor<Vector<F, VB>>,
    a_regs: &mut Array<Vector<F, VA>>,
    b_regs: &mut Array<Vector<F, VB>>,
    lo: &StridedView,
    ro: &StridedView,
    block: &Block,
    k0: usize,
    #[comptime] cfg: CmmaConfig,
) {
    let (a_kfast, b_nfast, threads, tile) =
        comptime!((cfg.a_kfast, cfg.b_nfast, cfg.threads, cfg.tile));
    let (row0, col0, m, n, k, tid) = (block.row0, block.col0, block.m, block.n, block.k, block.tid);
    let (a_so, a_si) = if comptime![a_kfast] {
        (lo.s0 as usize, lo.s1 as usize)
    } else {
        (lo.s1 as usize, lo.s0 as usize)
    };
    let (b_so, b_si) = if comptime![b_nfast] {
        (ro.s0 as usize, ro.s1 as usize)
    } else {
        (ro.s1 as usize, ro.s0 as usize)
    };
    let a_off = lo.offset as usize;
    let b_off = ro.offset as usize;
    fetch_a::<F, VA>(
        lhs, a_regs, a_off, a_so, a_si, row0, m, k0, k, tid, a_kfast, threads, tile,
    );
    fetch_b::<F, VB>(
        rhs, b_regs, b_off, b_so, b_si, col0, n, k0, k, tid, b_nfast, threads, tile,
    );
}

/// [`fetch_tile`] for the lhs stage at K origin `k0`.
#[cube]
fn fetch_a<F: Float, N: Size>(
    lhs: &Tensor<Vector<F, N>>,
    regs: &mut Array<Vector<F, N>>,
    off: usize,
    so: usize,
    si: usize,
    row0: usize,
    m: usize,
    k0: usize,
    k: usize,
    tid: usize,
    #[comptime] a_kfast: bool,
    #[comptime] threads: usize,
    #[comptime] tile: CmmaTile,
) {
    if comptime![a_kfast] {
        fetch_tile::<F, N>(
            lhs, regs, off, so, si, row0, m, k0, k, tid, tile.bm, tile.bk, threads,
        );
    } else {
        fetch_tile::<F, N>(
            lhs, regs, off, so, si, k0, k, row0, m, tid, tile.bk, tile.bm, threads,
        );
    }
}

/// [`fetch_tile`] for the rhs stage at K origin `k0`.
#[cube]
fn fetch_b<F: Float, N: Size>(
    rhs: &Tensor<Vector<F, N>>,
    regs: &mut Array<Vector<F, N>>,
    off: usize,
    so: usize,
    si: usize,
    col0: usize,
    n: usize,
    k0: usize,
    k: usize,
    tid: usize,
    #[comptime] b_nfast: bool,
    #[comptime] threads: usize,
    #[comptime] tile: CmmaTile,
) {
    if comptime![b_nfast] {
        fetch_tile::<F, N>(
            rhs, regs, off, so, si, k0, k, col0, n, tid, tile.bk, tile.bn, threads,
        );
    } else {
        fetch_tile::<F, N>(
            rhs, regs, off, so, si, col0, n, k0, k, tid, tile.bn, tile.bk, threads,
        );
    }
}
