//! The tensor-core GEMM with a multi-stage `cp.async` pipeline (CUDA, both operands 16-byte
//! vectors).
//!
//! Same staging layout, fragments (`ldmatrix` + `mma.sync` 16×8×16) and epilogue as the manual
//! path of the register-pipelined body ([`super::fragment`]), so the same MMA steps per output element in the same ascending K
//! order, hence the same bits whatever the tiling. Only the way bytes reach shared memory
//! differs: every unit copies its 16-byte vectors of a stage straight from global to shared
//! memory with `cp.async` (no register round trip) into a ring of `tile.stages` slots. Slot `s`
//! holds its stage once its `full` barrier completes the phase (every unit arrives after its
//! copies land). While stage `j` runs, the slot stage `j - lag` used is refilled with stage
//! `j + stages - lag`: with lag 1 after a cube barrier; with lag 2 after the slot's `free`
//! barrier (every unit arrives once done reading it), so planes never meet at a cube-wide barrier
//! and may drift apart by a stage. Vectors outside [M)×[K) / [K)×[N) are zero-filled by the copy
//! itself (source size 0).

// #[cube] functions take each tensor, shared memory and index as its own argument (they are
// expanded inline); the comptime choices travel together in `CmmaConfig`.
#![allow(clippy::too_many_arguments)]

use super::config::CmmaConfig;
use super::fragment::{
    Block, mma_stage_manual, store_manual, this_block, zero_manual_accumulators,
};
use crate::consts::CMMA_PAD;
use crate::gemm::view::StridedView;
use cubecl::prelude::barrier::{Barrier, copy_async_checked};
use cubecl::prelude::*;

/// Global → one shared stage (`base` in vectors) with `cp.async`: this unit's vectors of the
/// `outer × inner` tile at (`outer0`, `inner0`), inner contiguous (stride 1, host-checked), rows
/// padded by [`CMMA_PAD`]. Vectors outside (`outer_ext`, `inner_ext`) are zero-filled; with
/// `inner_ext`, the offset and `so` multiples of the vector width, a vector is wholly inside or
/// wholly outside.
#[cube]
fn copy_tile_async<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    smem: &mut SharedMemory<Vector<F, N>>,
    base: usize,
    off: usize,
    so: usize,
    outer0: usize,
    outer_ext: usize,
    inner0: usize,
    inner_ext: usize,
    tid: usize,
    #[comptime] outer: usize,
    #[comptime] inner: usize,
    #[comptime] threads: usize,
) {
    let width = N::value().comptime();
    let per_row = comptime!(inner / width);
    let pitch = comptime!((inner + CMMA_PAD) / width);
    let count = comptime!(outer * inner / width / threads);
    #[unroll]
    for e in 0..count {
        let v = tid + e * threads;
        let o = outer0 + v / per_row;
        let i = inner0 + (v % per_row) * width;
        let inside = o < outer_ext && i < inner_ext;
        // Out of range: a zero-length source at the tensor's start, so nothing is read.
        let src_at = select(inside, (off + o * so + i) / width, 0);
        let len = select(inside, 1usize, 0usize);
        let dst_at = base + (v / per_row) * pitch + v % per_row;
        copy_async_checked(
            &src.slice(src_at, src_at + len),
            &mut smem.slice_mut(dst_at, dst_at + 1),
            comptime!(width as u32),
        );
    }
}

/// Issue the copies of K stage `stage` into ring slot `slot`.
#[cube]
fn copy_stage_async<F: Float, VA: Size, VB: Size>(
    lhs: &Tensor<Vector<F, VA>>,
    rhs: &Tensor<Vector<F, VB>>,
    a_s: &mut SharedMemory<Vector<F, VA>>,
    b_s: &mut SharedMemory<Vector<F, VB>>,
    lo: &StridedView,
    ro: &StridedView,
    block: &Block,
    stage: usize,
    slot: usize,
    #[comptime] cfg: CmmaConfig,
) {
    let (a_kfast, b_nfast, threads, tile) =
        comptime!((cfg.a_kfast, cfg.b_nfast, cfg.threads, cfg.tile));
    let (row0, col0, m, n, k, tid) = (block.row0, block.col0, block.m, block.n, block.k, block.tid);
    let va = VA::value().comptime();
    let vb = VB::value().comptime();
    let k0 = stage * tile.bk;
    let a_len = comptime!(tile.a_stage_len(a_kfast) / va);
    let b_len = comptime!(tile.b_stage_len(b_nfast) / vb);
    let a_base = slot * a_len;
    let b_base = slot * b_len;
    let a_off = lo.offset as usize;
    let b_off = ro.offset as usize;
    if comptime![a_kfast] {
        copy_tile_async::<F, VA>(
            lhs,
            a_s,
            a_base,
            a_off,
            lo.s0 as usize,
            row0,
            m,
            k0,
            k,
            tid,
            tile.bm,
            tile.bk,
            threads,
        );
    } else {
        copy_tile_async::<F, VA>(
            lhs,
            a_s,
            a_base,
            a_off,
            lo.s1 as usize,
            k0,
            k,
            row0,
            m,
            tid,
            tile.bk,
            tile.bm,
            threads,
        );
    }
    if comptime![b_nfast] {
        copy_tile_async::<F, VB>(
            rhs,
            b_s,
            b_base,
            b_off,
            ro.s0 as usize,
            k0,
            k,
            col0,
            n,
            tid,
            tile.bk,
            tile.bn,
            threads,
        );
    } else {
        copy_tile_async::<F, VB>(
            rhs,
            b_s,
            b_base,
            b_off,
            ro.s1 as usize,
            col0,
            n,
            k0,
            k,
            tid,
            tile.bn,
            tile.bk,
            threads,
        );
    }
}

/// Mark this unit's copies to ring slot `slot` as part of the slot barrier's current phase, then
/// arrive (the phase completes once every unit arrived and all their copies landed).
#[cube]
pub(crate) fn arrive_on_copies(full: &Sequence<Shared<Barrier>>, #[comptime] slot: usize) {
    let bar = full.index(slot);
    bar.commit_copy_async();
    let _ = bar.arrive();
}

/// `count` cube-wide barriers of the ring.
#[cube]
pub(crate) fn ring_barriers(#[comptime] count: usize) -> Sequence<Shared<Barrier>> {
    let mut barriers = Sequence::<Shared<Barrier>>::new();
    #[unroll]
    for _ in 0..count {
        barriers.push(Barrier::shared(CUBE_DIM, UNIT_POS == 0));
    }
    barriers
}

/// The body of `gemm_cmma_kernel` when it runs the ring (the launch decides).
#[cube]
pub(crate) fn gemm_ring<F: Float, O: Float, VA: Size, VB: Size>(
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
    let (ring, lag) = comptime!((tile.stages, tile.lag));
    let block = this_block(m, k, n, cfg);
    let plane = UNIT_POS_Y as usize;
    let prow = (plane / comptime!(tile.pn)) * comptime!(tile.bm / tile.pm);
    let pcol = (plane % comptime!(tile.pn)) * comptime!(tile.bn / tile.pn);
    let va = VA::value().comptime();
    let vb = VB::value().comptime();
    let a_len = comptime!(tile.a_stage_len(cfg.a_kfast) / va);
    let b_len = comptime!(tile.b_stage_len(cfg.b_nfast) / vb);

    let mut a_s = SharedMemory::<Vector<F, VA>>::new_aligned(comptime!(ring * a_len), 16usize);
    let mut b_s = SharedMemory::<Vector<F, VB>>::new_aligned(comptime!(ring * b_len), 16usize);
    // `full[s]`: slot `s` holds its stage (every unit arrived after its copies landed);
    // `free[s]` (lag 2): every unit is done reading slot `s`.
    let full = ring_barriers(ring);
    let free = ring_barriers(comptime!(if lag == 2 { ring } else { 0 }));
    sync_cube();
    let mut regs_c = zero_manual_accumulators(cfg);

    let num_stages = block.k.div_ceil(tile.bk);
    // Prologue: stages 0 .. ring - lag in flight. A slot whose stage does not exist still
    // completes its phase (every unit arrives), so the phases stay in step.
    #[unroll]
    for s in 0..comptime!(ring - lag) {
        if s < num_stages {
            copy_stage_async::<F, VA, VB>(lhs, rhs, &mut a_s, &mut b_s, lo, ro, &block, s, s, cfg);
        }
        arrive_on_copies(&full, s);
    }

    // Stage `g * ring + s` lives in slot `s`; it is the slot's `g`-th phase. While it runs, the
    // slot stage `g * ring + s - lag` used is refilled with stage `g * ring + s + ring - lag`.
    for g in 0..num_stages.div_ceil(ring) {
        let parity = (g % 2) as u32;
        #[unroll]
        for s in 0..ring {
            let stage = g * ring + s;
            if stage < num_stages {
                let refill = comptime!((s + ring - lag) % ring);
                let ahead = stage + ring - lag;
                release_slot(&full, &free, s, refill, stage, parity, cfg);
                if ahead < num_stages {
                    copy_stage_async::<F, VA, VB>(
                        lhs, rhs, &mut a_s, &mut b_s, lo, ro, &block, ahead, refill, cfg,
                    );
                }
                arrive_on_copies(&full, refill);
                if comptime![lag == 2] {
                    full.index(s).wait_parity(parity);
                }
                mma_stage_manual::<F, VA, VB>(
                    &a_s,
                    &b_s,
                    s * a_len,
                    s * b_len,
                    &mut regs_c,
                    prow,
                    pcol,
                    cfg,
                );
                if comptime![lag == 2] {
                    let _ = free.index(s).arrive();
                }
            }
        }
    }

    let (row0, col0) = (block.row0 + prow, block.col0 + pcol);
    let (m, n) = (block.m, block.n);
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
}

/// Before stage `stage` (in slot `s`) refills slot `refill`: with lag 1 wait for stage `stage`'s
/// copies, then for every plane to be done with the previous stage; with lag 2 wait for the
/// refilled slot's last user, stage `stage - lag` (its phase `(stage - lag) / ring`).
#[cube]
fn release_slot(
    full: &Sequence<Shared<Barrier>>,
    free: &Sequence<Shared<Barrier>>,
    #[comptime] s: usize,
    #[comptime] refill: usize,
    stage: usize,
    parity: u32,
    #[comptime] cfg: CmmaConfig,
) {
    let (ring, lag) = comptime!((cfg.tile.stages, cfg.tile.lag));
    if comptime![lag == 1] {
        full.index(s).wait_parity(parity);
        // Every plane is done with the previous stage's slot.
        sync_cube();
    } else if stage >= lag {
        free.index(refill)
            .wait_parity(((stage - lag) / ring % 2) as u32);
    }
}
