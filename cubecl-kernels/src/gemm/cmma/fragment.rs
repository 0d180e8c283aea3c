//! Fragment-level steps shared by both cmma kernel bodies: operand tiles between global,
//! registers and shared memory, the 16-deep MMA steps of one staged K block (by hand with
//! `ldmatrix` + `mma.sync`, or through WMMA `cmma`), and the epilogues that add the bias in f32
//! and round once.
// #[cube] functions take each tensor, shared memory and index as its own argument (they are
// expanded inline); the comptime choices travel together in `CmmaConfig`.
#![allow(clippy::too_many_arguments)]

use super::config::CmmaConfig;
use crate::consts::{CMMA_FRAG, CMMA_PAD};
use crate::gemm::view::StridedView;
use cubecl::prelude::*;

/// Where a cube works: its output block's origin (`row0`, `col0`) in the `[m, n]` output, the
/// reduction length `k`, and this unit's index in the cube.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct Block {
    pub row0: usize,
    pub col0: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub tid: usize,
}

/// This cube's [`Block`] of a `[m, k] · [k, n]` product.
#[cube]
pub(crate) fn this_block(m: u32, k: u32, n: u32, #[comptime] cfg: CmmaConfig) -> Block {
    Block {
        row0: CUBE_POS_X as usize * cfg.tile.bm,
        col0: CUBE_POS_Y as usize * cfg.tile.bn,
        m: m as usize,
        n: n as usize,
        k: k as usize,
        tid: UNIT_POS as usize,
    }
}

/// Global → registers: this unit's vectors of the `outer × inner` tile at (`outer0`, `inner0`).
/// Elements outside (`outer_ext`, `inner_ext`) read as zero. With vectors wider than one element,
/// `si == 1` and `inner_ext`, the offset and `so` are multiples of the width (host-checked), so a
/// vector is either wholly inside or wholly outside.
#[cube]
pub(crate) fn fetch_tile<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    regs: &mut Array<Vector<F, N>>,
    off: usize,
    so: usize,
    si: usize,
    outer0: usize,
    outer_ext: usize,
    inner0: usize,
    inner_ext: usize,
    tid: usize,
    #[comptime] outer: usize,
    #[comptime] inner: usize,
    #[comptime] threads: usize,
) {
    let width = src.vector_size().comptime();
    let per_row = comptime!(inner / width);
    let count = comptime!(outer * inner / width / threads);
    #[unroll]
    for e in 0..count {
        let v = tid + e * threads;
        let o = outer0 + v / per_row;
        let i = inner0 + (v % per_row) * width;
        let mut val = Vector::<F, N>::new(F::new(0.0));
        if o < outer_ext && i < inner_ext {
            val = src[(off + o * so + i * si) / width];
        }
        regs[e] = val;
    }
}

/// Registers → one shared stage (`base` in vectors), same unit-to-vector mapping as
/// [`fetch_tile`].
#[cube]
pub(crate) fn stash_tile<F: Float, N: Size>(
    regs: &Array<Vector<F, N>>,
    smem: &mut SharedMemory<Vector<F, N>>,
    base: usize,
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
        smem[base + (v / per_row) * pitch + v % per_row] = regs[e];
    }
}

/// The accumulators of the manual path: per 16×8 fragment, two f32 pairs per lane, zeroed
/// (none where the kernel is not on the manual path).
#[cube]
pub(crate) fn zero_manual_accumulators(
    #[comptime] cfg: CmmaConfig,
) -> Sequence<Array<Vector<f32, Const<2>>>> {
    let mut regs_c = Sequence::<Array<Vector<f32, Const<2>>>>::new();
    let count = comptime!(if cfg.manual {
        cfg.tile.bm / cfg.tile.pm / CMMA_FRAG * (cfg.tile.bn / cfg.tile.pn / 8)
    } else {
        0
    });
    #[unroll]
    for _ in 0..count {
        let mut c = Array::<Vector<f32, Const<2>>>::new(2usize);
        c[0] = Vector::new(0.0f32);
        c[1] = Vector::new(0.0f32);
        regs_c.push(c);
    }
    regs_c
}

/// One staged K block through this plane's fragments on the manual path: `ldmatrix` (transposed
/// where the operand is staged the other way round) and `mma.sync` 16×8×16, 16-deep steps in
/// ascending K. The stages start at `a_base` / `b_base` (in vectors).
///
/// ldmatrix: lane l addresses row `l % 8` of 8×8 matrix `l / 8`; matrices 0..3 are (rows 0-7,
/// k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) of a 16×16 A tile and
/// (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) of two 16×8 B tiles.
#[cube]
pub(crate) fn mma_stage_manual<F: Float, VA: Size, VB: Size>(
    a_s: &SharedMemory<Vector<F, VA>>,
    b_s: &SharedMemory<Vector<F, VB>>,
    a_base: usize,
    b_base: usize,
    regs_c: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    prow: usize,
    pcol: usize,
    #[comptime] cfg: CmmaConfig,
) {
    let (a_kfast, b_nfast, tile) = comptime!((cfg.a_kfast, cfg.b_nfast, cfg.tile));
    let mma = cmma::MmaDefinition::<F, F, f32>::new(CMMA_FRAG, 8usize, CMMA_FRAG);
    let frags_m = comptime!(tile.bm / tile.pm / CMMA_FRAG);
    let n8 = comptime!(tile.bn / tile.pn / 8);
    let va = VA::value().comptime();
    let vb = VB::value().comptime();
    let (a_inner, b_inner) = comptime!((
        if a_kfast { tile.bk } else { tile.bm },
        if b_nfast { tile.bn } else { tile.bk }
    ));
    let a_pitch = comptime!(a_inner + CMMA_PAD);
    let b_pitch = comptime!(b_inner + CMMA_PAD);
    let lane = UNIT_POS_X as usize;
    let quad = lane / 8;
    let within = lane % 8;
    #[unroll]
    for s in 0..comptime!(tile.bk / CMMA_FRAG) {
        let kk = s * CMMA_FRAG;
        let mut regs_a = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for i in 0..frags_m {
            let r = prow + i * CMMA_FRAG;
            let e = if comptime![a_kfast] {
                (r + (quad % 2) * 8 + within) * a_pitch + kk + (quad / 2) * 8
            } else {
                (kk + (quad / 2) * 8 + within) * a_pitch + r + (quad % 2) * 8
            };
            let start = a_base + e / va;
            regs_a.push(mma.load_matrix::<Vector<F, VA>, Const<2>>(
                &a_s.slice(start, start + comptime!(8 / va)),
                cmma::MatrixIdent::A,
                4usize,
                comptime!(!a_kfast),
            ));
        }
        #[unroll]
        for j in 0..comptime!(n8 / 2) {
            let c = pcol + j * CMMA_FRAG;
            let e = if comptime![b_nfast] {
                (kk + (quad % 2) * 8 + within) * b_pitch + c + (quad / 2) * 8
            } else {
                (c + (quad / 2) * 8 + within) * b_pitch + kk + (quad % 2) * 8
            };
            let start = b_base + e / vb;
            let pair = mma.load_matrix::<Vector<F, VB>, Const<2>>(
                &b_s.slice(start, start + comptime!(8 / vb)),
                cmma::MatrixIdent::B,
                4usize,
                b_nfast,
            );
            let mut b_lo = Array::<Vector<F, Const<2>>>::new(2usize);
            b_lo[0] = pair[0];
            b_lo[1] = pair[1];
            let mut b_hi = Array::<Vector<F, Const<2>>>::new(2usize);
            b_hi[0] = pair[2];
            b_hi[1] = pair[3];
            #[unroll]
            for i in 0..frags_m {
                mma.execute_inplace(
                    regs_a.index(i),
                    &b_lo,
                    regs_c.index_mut(comptime!(i * n8 + 2 * j)),
                );
                mma.execute_inplace(
                    regs_a.index(i),
                    &b_hi,
                    regs_c.index_mut(comptime!(i * n8 + 2 * j + 1)),
                );
            }
        }
    }
}

/// The manual path's epilogue: each lane's accumulators (plus the bias, in f32; plus the output's
/// old value where the launch accumulates) rounded once to the output dtype and stored. The plane's block starts at (`row0`, `col0`).
#[cube]
pub(crate) fn store_manual<F: Float, O: Float>(
    regs_c: &Sequence<Array<Vector<f32, Const<2>>>>,
    bias: &Tensor<F>,
    bias_off: u32,
    bias_stride: u32,
    out: &mut Tensor<O>,
    oo: &StridedView,
    row0: usize,
    col0: usize,
    m: usize,
    n: usize,
    #[comptime] cfg: CmmaConfig,
) {
    let (has_bias, tile) = comptime!((cfg.has_bias, cfg.tile));
    let frags_m = comptime!(tile.bm / tile.pm / CMMA_FRAG);
    let n8 = comptime!(tile.bn / tile.pn / 8);
    let o_off = oo.offset as usize;
    let o_s0 = oo.s0 as usize;
    let o_s1 = oo.s1 as usize;
    // Lane (g, t) = (lane / 4, lane % 4) holds rows g and g + 8, columns 2t and 2t + 1.
    let lane = UNIT_POS_X as usize;
    let g = lane / 4;
    let t = lane % 4;
    #[unroll]
    for i in 0..frags_m {
        #[unroll]
        for j in 0..n8 {
            let regs = regs_c.index(comptime!(i * n8 + j));
            #[unroll]
            for h in 0..2usize {
                let row = row0 + i * CMMA_FRAG + g + h * 8;
                let pair = regs[h];
                #[unroll]
                for q in 0..2usize {
                    let col = col0 + j * 8 + 2 * t + q;
                    if row < m && col < n {
                        let mut v = pair[q];
                        if comptime![has_bias] {
                            v += f32::cast_from(
                                bias[bias_off as usize + col * bias_stride as usize],
                            );
                        }
                        let o = o_off + row * o_s0 + col * o_s1;
                        if comptime![cfg.accumulate] {
                            v += f32::cast_from(out[o]);
                        }
                        out[o] = O::cast_from(v);
                    }
                }
            }
        }
    }
}

/// The accumulators of the WMMA path: `frags_m × frags_n` zeroed 16×16 f32 fragments (none on
/// the manual path).
#[cube]
pub(crate) fn wmma_accumulators(#[comptime] cfg: CmmaConfig) -> Sequence<cmma::Matrix<f32>> {
    let count = comptime!(if cfg.manual {
        0
    } else {
        cfg.tile.bm / cfg.tile.pm / CMMA_FRAG * (cfg.tile.bn / cfg.tile.pn / CMMA_FRAG)
    });
    let mut accs = Sequence::<cmma::Matrix<f32>>::new();
    #[unroll]
    for _ in 0..count {
        accs.push(cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            CMMA_FRAG,
            CMMA_FRAG,
            CMMA_FRAG,
            cmma::MatrixLayout::Undefined,
            0.0,
        ));
    }
    accs
}

/// The A (`lhs`) or B operand fragments of the WMMA path: one per row (column) of the plane's
/// fragments, loaded row-major where the operand is staged that way (none on the manual path).
#[cube]
pub(crate) fn wmma_operands<F: Float>(
    #[comptime] cfg: CmmaConfig,
    #[comptime] lhs: bool,
) -> Sequence<cmma::Matrix<F>> {
    let tile = comptime!(cfg.tile);
    let (ident, per_plane, row_major) = comptime!(if lhs {
        (cmma::MatrixIdent::A, tile.bm / tile.pm, cfg.a_kfast)
    } else {
        (cmma::MatrixIdent::B, tile.bn / tile.pn, cfg.b_nfast)
    });
    let count = comptime!(if cfg.manual { 0 } else { per_plane / CMMA_FRAG });
    let layout = comptime!(if row_major {
        cmma::MatrixLayout::RowMajor
    } else {
        cmma::MatrixLayout::ColMajor
    });
    let mut frags = Sequence::<cmma::Matrix<F>>::new();
    #[unroll]
    for _ in 0..count {
        frags.push(unsafe {
            cmma::Matrix::<F>::uninitialized(ident, CMMA_FRAG, CMMA_FRAG, CMMA_FRAG, layout)
        });
    }
    frags
}

/// One staged K block through this plane's WMMA fragments: 16-deep steps in ascending K, each
/// loading the plane's A and B fragments from the stage (at `a_base` / `b_base`, in vectors)
/// and accumulating every (A, B) pair.
#[cube]
pub(crate) fn mma_stage_wmma<F: Float, VA: Size, VB: Size>(
    a_s: &SharedMemory<Vector<F, VA>>,
    b_s: &SharedMemory<Vector<F, VB>>,
    a_base: usize,
    b_base: usize,
    accs: &mut Sequence<cmma::Matrix<f32>>,
    a_frags: &mut Sequence<cmma::Matrix<F>>,
    b_frags: &mut Sequence<cmma::Matrix<F>>,
    prow: usize,
    pcol: usize,
    #[comptime] cfg: CmmaConfig,
) {
    let (a_kfast, b_nfast, tile) = comptime!((cfg.a_kfast, cfg.b_nfast, cfg.tile));
    let frags_m = comptime!(tile.bm / tile.pm / CMMA_FRAG);
    let frags_n = comptime!(tile.bn / tile.pn / CMMA_FRAG);
    let va = VA::value().comptime();
    let vb = VB::value().comptime();
    let a_pitch = comptime!((if a_kfast { tile.bk } else { tile.bm }) + CMMA_PAD);
    let b_pitch = comptime!((if b_nfast { tile.bn } else { tile.bk }) + CMMA_PAD);
    #[unroll]
    for s in 0..comptime!(tile.bk / CMMA_FRAG) {
        let kk = s * CMMA_FRAG;
        #[unroll]
        for i in 0..frags_m {
            let r = prow + i * CMMA_FRAG;
            // Element offset of fragment (r, kk) in the stage, then in vectors.
            let e = if comptime![a_kfast] {
                r * a_pitch + kk
            } else {
                kk * a_pitch + r
            };
            let start = a_base + e / va;
            let len = comptime!(((CMMA_FRAG - 1) * a_pitch + CMMA_FRAG) / va);
            cmma::load(
                a_frags.index(i),
                &a_s.slice(start, start + len),
                a_pitch as u32,
            );
        }
        #[unroll]
        for j in 0..frags_n {
            let c = pcol + j * CMMA_FRAG;
            let e = if comptime![b_nfast] {
                kk * b_pitch + c
            } else {
                c * b_pitch + kk
            };
            let start = b_base + e / vb;
            let len = comptime!(((CMMA_FRAG - 1) * b_pitch + CMMA_FRAG) / vb);
            cmma::load(
                b_frags.index(j),
                &b_s.slice(start, start + len),
                b_pitch as u32,
            );
        }
        #[unroll]
        for i in 0..frags_m {
            #[unroll]
            for j in 0..frags_n {
                let acc = accs.index(comptime!(i * frags_n + j));
                cmma::execute::<F, F, f32, f32>(a_frags.index(i), b_frags.index(j), acc, acc);
            }
        }
    }
}

/// The WMMA path's epilogue, one fragment at a time through this plane's 16×16 f32 scratch
/// (`scratch` in `c_s`): plus the bias in f32 (and the output's old value where the launch
/// accumulates), rounded once, stored. The plane's block starts
/// at (`row0`, `col0`).
#[cube]
pub(crate) fn store_wmma<F: Float, O: Float>(
    accs: &Sequence<cmma::Matrix<f32>>,
    c_s: &mut SharedMemory<f32>,
    scratch: usize,
    bias: &Tensor<F>,
    bias_off: u32,
    bias_stride: u32,
    out: &mut Tensor<O>,
    oo: &StridedView,
    row0: usize,
    col0: usize,
    m: usize,
    n: usize,
    #[comptime] cfg: CmmaConfig,
) {
    let frags_m = comptime!(cfg.tile.bm / cfg.tile.pm / CMMA_FRAG);
    let frags_n = comptime!(cfg.tile.bn / cfg.tile.pn / CMMA_FRAG);
    let o_off = oo.offset as usize;
    let o_s0 = oo.s0 as usize;
    let o_s1 = oo.s1 as usize;
    let lane = UNIT_POS_X as usize;
    let plane_dim = CUBE_DIM_X as usize;
    let per_lane = comptime!(CMMA_FRAG * CMMA_FRAG) / plane_dim;
    #[unroll]
    for i in 0..frags_m {
        #[unroll]
        for j in 0..frags_n {
            cmma::store(
                &mut c_s.slice_mut(scratch, scratch + CMMA_FRAG * CMMA_FRAG),
                accs.index(comptime!(i * frags_n + j)),
                CMMA_FRAG as u32,
                cmma::MatrixLayout::RowMajor,
            );
            sync_cube();
            for e in 0..per_lane {
                let idx = e * plane_dim + lane;
                let row = row0 + i * CMMA_FRAG + idx / CMMA_FRAG;
                let col = col0 + j * CMMA_FRAG + idx % CMMA_FRAG;
                if row < m && col < n {
                    let mut v = c_s[scratch + idx];
                    if comptime![cfg.has_bias] {
                        v += f32::cast_from(bias[bias_off as usize + col * bias_stride as usize]);
                    }
                    let o = o_off + row * o_s0 + col * o_s1;
                    if comptime![cfg.accumulate] {
                        v += f32::cast_from(out[o]);
                    }
                    out[o] = O::cast_from(v);
                }
            }
            sync_cube();
        }
    }
}

/// Both operands' register tiles into shared stage `buffer` (0 or 1) of the register-pipelined
/// body.
#[cube]
pub(crate) fn stash_stage<F: Float, VA: Size, VB: Size>(
    a_regs: &Array<Vector<F, VA>>,
    b_regs: &Array<Vector<F, VB>>,
    a_s: &mut SharedMemory<Vector<F, VA>>,
    b_s: &mut SharedMemory<Vector<F, VB>>,
    buffer: usize,
    tid: usize,
    #[comptime] cfg: CmmaConfig,
) {
    let (a_outer, a_inner, b_outer, b_inner) = comptime!(operand_tiles(cfg));
    let va = VA::value().comptime();
    let vb = VB::value().comptime();
    let a_stage = comptime!(crate::consts::stage_len(a_outer, a_inner) / va);
    let b_stage = comptime!(crate::consts::stage_len(b_outer, b_inner) / vb);
    let threads = comptime!(cfg.threads);
    stash_tile::<F, VA>(
        a_regs,
        a_s,
        buffer * a_stage,
        tid,
        a_outer,
        a_inner,
        threads,
    );
    stash_tile::<F, VB>(
        b_regs,
        b_s,
        buffer * b_stage,
        tid,
        b_outer,
        b_inner,
        threads,
    );
}

/// The operand tiles in their own orientation: `(a_outer, a_inner, b_outer, b_inner)`, inner
/// contiguous.
pub(crate) fn operand_tiles(cfg: CmmaConfig) -> (usize, usize, usize, usize) {
    let crate::consts::CmmaTile { bm, bn, bk, .. } = cfg.tile;
    let (a_outer, a_inner) = if cfg.a_kfast { (bm, bk) } else { (bk, bm) };
    let (b_outer, b_inner) = if cfg.b_nfast { (bk, bn) } else { (bn, bk) };
    (a_outer, a_inner, b_outer, b_inner)
}
