//! The cooperative-matrix (tensor core) GEMM for f16 / bf16 inputs.
//!
//! Tiling ([`CmmaTile`], pinned in [`crate::consts::CMMA_TILE`]): an output block per cube, split
//! among planes that each own whole 16×16×16 fragments; K staged through shared memory in
//! fixed-depth stages of 16-deep MMA steps, walked in one ascending order. Accumulators are f32.
//!
//! Pipelining: the shared-memory stages are double-buffered and the next stage's global loads are
//! issued into registers before the current stage's MMAs, so global latency overlaps the tensor
//! cores with one cube barrier per stage. (On CUDA, where both operands are 16-byte vectors,
//! [`super::cmma_async`] runs instead: a `cp.async` ring with its own pinned tiling,
//! [`crate::consts::CMMA_ASYNC_TILE`], and this module's fragment code and epilogue.) Each operand is staged in its own memory orientation
//! (the contiguous dimension stays contiguous in shared memory, rows padded by 8 elements against
//! bank conflicts) and the fragments are loaded row- or column-major to match. Global loads use
//! `VA` / `VB`-element vectors where the host found the operand contiguous and aligned, else
//! scalars; the vector width only changes how bytes travel, never the arithmetic.
//!
//! Fragments: on CUDA ([`super::manual_mma_supported`]) each plane loads its operands with
//! `ldmatrix` (transposed where the operand is staged the other way round) and issues
//! `mma.sync` 16×8×16 on per-lane registers; elsewhere it uses WMMA-style `cmma` 16×16×16
//! fragments. A 16×16×16 step is two 16×8×16 steps either way, so both give the same bits.
//!
//! Positions outside [M)×[K) / [K)×[N) are staged as zeros, which only ever meet other zeros or
//! in-range values of the same output element, so the padding depends on K and N, never on M. The
//! epilogue adds the bias in f32 and rounds once to the output dtype: from the lanes' registers
//! on the manual path, through a per-plane f32 scratch on the `cmma` path.

use super::cmma_async::gemm_ring;
use crate::consts::{CMMA_FRAG, CMMA_PAD};
use crate::gemm::fma::Operand;
use cubecl::prelude::*;

/// The cube's tiling: output block `bm × bn`, K stage depth `bk`, planes `pm × pn` (plane-major
/// along N). Every tiling computes each output element with the same sequence of 16-deep MMA
/// steps in ascending K, so all tilings give the same bits; one is pinned for [`crate::matmul`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmmaTile {
    /// Output rows per cube.
    pub bm: usize,
    /// Output columns per cube.
    pub bn: usize,
    /// K depth of one shared-memory stage.
    pub bk: usize,
    /// Planes along M.
    pub pm: usize,
    /// Planes along N.
    pub pn: usize,
    /// Shared-memory stages in the ring of the `cp.async` pipeline (CUDA, 16-byte aligned
    /// operands); elsewhere the kernel double-buffers through registers.
    pub stages: usize,
    /// `cp.async` ring: the slot refilled while stage `j` runs is the one stage `j - lag` used.
    /// 1: after a cube barrier; 2 (needs `stages ≥ 3`): after that slot's release barrier, so
    /// planes drift apart by up to a stage instead of meeting at a cube barrier every stage.
    pub lag: usize,
}

impl CmmaTile {
    /// Planes per cube.
    pub fn planes(&self) -> usize {
        self.pm * self.pn
    }

    /// Whether the tiling is well formed: every plane owns whole 16×16 fragments, the stage is
    /// whole MMA steps, and each unit moves a whole number of vectors.
    pub fn is_valid(&self, plane_size: usize) -> bool {
        let threads = plane_size * self.planes();
        let f = CMMA_FRAG;
        self.pm > 0
            && self.pn > 0
            && self.bm.is_multiple_of(self.pm * f)
            && self.bn.is_multiple_of(self.pn * f)
            && self.bk.is_multiple_of(f)
            && (self.bm * self.bk).is_multiple_of(threads * crate::consts::CMMA_VECTOR)
            && (self.bn * self.bk).is_multiple_of(threads * crate::consts::CMMA_VECTOR)
            && (f * f).is_multiple_of(plane_size)
    }

    /// Elements of one shared stage of the lhs tile, staged K-contiguous or M-contiguous.
    pub const fn a_stage_len(&self, a_kfast: bool) -> usize {
        if a_kfast {
            stage_len(self.bm, self.bk)
        } else {
            stage_len(self.bk, self.bm)
        }
    }

    /// Elements of one shared stage of the rhs tile, staged N-contiguous or K-contiguous.
    pub const fn b_stage_len(&self, b_nfast: bool) -> usize {
        if b_nfast {
            stage_len(self.bk, self.bn)
        } else {
            stage_len(self.bn, self.bk)
        }
    }

    /// Elements of one stage of both operands, each in its larger orientation.
    fn stage_elems(&self) -> usize {
        self.a_stage_len(true).max(self.a_stage_len(false))
            + self.b_stage_len(true).max(self.b_stage_len(false))
    }

    /// Shared memory the register-pipelined kernel uses, in bytes, for `elem_size`-byte operands
    /// (two stages, plus the `cmma` epilogue scratch).
    pub fn shared_bytes(&self, elem_size: usize) -> usize {
        2 * self.stage_elems() * elem_size + self.planes() * CMMA_FRAG * CMMA_FRAG * 4
    }

    /// Shared memory the `cp.async` kernel uses, in bytes (the ring of stages; the barriers
    /// take 8 bytes each, counted generously).
    pub fn async_shared_bytes(&self, elem_size: usize) -> usize {
        self.stages * self.stage_elems() * elem_size + 16 * self.stages
    }

    /// Whether the `cp.async` ring is well formed: at least two stages and a lag that leaves a
    /// stage in flight.
    pub fn ring_is_valid(&self) -> bool {
        self.stages >= 2 && self.lag >= 1 && self.lag < self.stages && self.lag <= 2
    }
}

/// Elements of one shared stage of an operand tile `outer × inner` (inner contiguous, padded).
pub(crate) const fn stage_len(outer: usize, inner: usize) -> usize {
    outer * (inner + CMMA_PAD)
}

/// Global → registers: this unit's vectors of the `outer × inner` tile at (`outer0`, `inner0`).
/// Elements outside (`outer_ext`, `inner_ext`) read as zero. With vectors wider than one element,
/// `si == 1` and `inner_ext`, the offset and `so` are multiples of the width (host-checked), so a
/// vector is either wholly inside or wholly outside.
#[cube]
#[allow(clippy::too_many_arguments)]
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

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_cmma_kernel<F: Float, VA: Size, VB: Size>(
    lhs: &Tensor<Vector<F, VA>>,
    lo: Operand,
    rhs: &Tensor<Vector<F, VB>>,
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
    #[comptime] a_kfast: bool,
    #[comptime] b_nfast: bool,
    #[comptime] threads: usize,
    #[comptime] tile: CmmaTile,
    #[comptime] manual: bool,
    #[comptime] ring: bool,
    #[define(F)] _dtype: StorageType,
) {
    if comptime![ring] {
        gemm_ring::<F, VA, VB>(
            lhs,
            &lo,
            rhs,
            &ro,
            bias,
            bias_off,
            bias_stride,
            out,
            &oo,
            m,
            k,
            n,
            has_bias,
            a_kfast,
            b_nfast,
            threads,
            tile,
        );
    } else {
        gemm_registers::<F, VA, VB>(
            lhs,
            &lo,
            rhs,
            &ro,
            bias,
            bias_off,
            bias_stride,
            out,
            &oo,
            m,
            k,
            n,
            has_bias,
            a_kfast,
            b_nfast,
            threads,
            tile,
            manual,
        );
    }
}

/// The register-pipelined body of [`gemm_cmma_kernel`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn gemm_registers<F: Float, VA: Size, VB: Size>(
    lhs: &Tensor<Vector<F, VA>>,
    lo: &Operand,
    rhs: &Tensor<Vector<F, VB>>,
    ro: &Operand,
    bias: &Tensor<F>,
    bias_off: u32,
    bias_stride: u32,
    out: &mut Tensor<F>,
    oo: &Operand,
    m: u32,
    k: u32,
    n: u32,
    #[comptime] has_bias: bool,
    #[comptime] a_kfast: bool,
    #[comptime] b_nfast: bool,
    #[comptime] threads: usize,
    #[comptime] tile: CmmaTile,
    #[comptime] manual: bool,
) {
    let bm = comptime!(tile.bm);
    let bn = comptime!(tile.bn);
    let bk = comptime!(tile.bk);
    let plane_m = comptime!(tile.bm / tile.pm);
    let plane_n = comptime!(tile.bn / tile.pn);
    let frags_m = comptime!(plane_m / CMMA_FRAG);
    let frags_n = comptime!(plane_n / CMMA_FRAG);
    let m = m as usize;
    let k = k as usize;
    let n = n as usize;
    let row0 = CUBE_POS_X as usize * bm;
    let col0 = CUBE_POS_Y as usize * bn;
    let plane = UNIT_POS_Y as usize;
    let tid = UNIT_POS as usize;
    let prow = (plane / comptime!(tile.pn)) * plane_m;
    let pcol = (plane % comptime!(tile.pn)) * plane_n;
    let va = VA::value().comptime();
    let vb = VB::value().comptime();

    // Operand tiles in their own orientation: (outer, inner) with inner contiguous.
    let (a_outer, a_inner) = comptime!(if a_kfast { (bm, bk) } else { (bk, bm) });
    let (b_outer, b_inner) = comptime!(if b_nfast { (bk, bn) } else { (bn, bk) });
    let a_pitch = comptime!(a_inner + CMMA_PAD);
    let b_pitch = comptime!(b_inner + CMMA_PAD);
    let a_stage = comptime!(stage_len(a_outer, a_inner) / va);
    let b_stage = comptime!(stage_len(b_outer, b_inner) / vb);
    let a_layout = comptime!(if a_kfast {
        cmma::MatrixLayout::RowMajor
    } else {
        cmma::MatrixLayout::ColMajor
    });
    let b_layout = comptime!(if b_nfast {
        cmma::MatrixLayout::RowMajor
    } else {
        cmma::MatrixLayout::ColMajor
    });

    let mut a_s = SharedMemory::<Vector<F, VA>>::new_aligned(comptime!(2 * a_stage), 16usize);
    let mut b_s = SharedMemory::<Vector<F, VB>>::new_aligned(comptime!(2 * b_stage), 16usize);
    let mut c_s = SharedMemory::<f32>::new_aligned(
        comptime!(tile.pm * tile.pn * CMMA_FRAG * CMMA_FRAG),
        16usize,
    );
    let mut a_regs = Array::<Vector<F, VA>>::new(comptime!(a_outer * a_inner / va / threads));
    let mut b_regs = Array::<Vector<F, VB>>::new(comptime!(b_outer * b_inner / vb / threads));

    // Fragments: `cmma` (WMMA) 16×16 matrices, or, on the manual path, per-lane registers of
    // 16×8×16 MMAs (A: 16×16, B: 16×8 in pairs, accumulators 16×8 as two f32 pairs).
    let mut accs = Sequence::<cmma::Matrix<f32>>::new();
    let mut a_frags = Sequence::<cmma::Matrix<F>>::new();
    let mut b_frags = Sequence::<cmma::Matrix<F>>::new();
    let mut regs_c = zero_manual_accumulators(tile, manual);
    if comptime![!manual] {
        #[unroll]
        for _ in 0..comptime!(frags_m * frags_n) {
            accs.push(cmma::Matrix::<f32>::from_value(
                cmma::MatrixIdent::Accumulator,
                CMMA_FRAG,
                CMMA_FRAG,
                CMMA_FRAG,
                cmma::MatrixLayout::Undefined,
                0.0,
            ));
        }
        #[unroll]
        for _ in 0..frags_m {
            a_frags.push(unsafe {
                cmma::Matrix::<F>::uninitialized(
                    cmma::MatrixIdent::A,
                    CMMA_FRAG,
                    CMMA_FRAG,
                    CMMA_FRAG,
                    a_layout,
                )
            });
        }
        #[unroll]
        for _ in 0..frags_n {
            b_frags.push(unsafe {
                cmma::Matrix::<F>::uninitialized(
                    cmma::MatrixIdent::B,
                    CMMA_FRAG,
                    CMMA_FRAG,
                    CMMA_FRAG,
                    b_layout,
                )
            });
        }
    }

    let num_stages = k.div_ceil(bk);
    // Prologue: stage 0 into buffer 0.
    fetch_stage::<F, VA, VB>(
        lhs,
        rhs,
        &mut a_regs,
        &mut b_regs,
        lo,
        ro,
        row0,
        col0,
        m,
        n,
        0,
        k,
        tid,
        a_kfast,
        b_nfast,
        threads,
        tile,
    );
    stash_tile::<F, VA>(&a_regs, &mut a_s, 0, tid, a_outer, a_inner, threads);
    stash_tile::<F, VB>(&b_regs, &mut b_s, 0, tid, b_outer, b_inner, threads);
    sync_cube();

    for stage in 0..num_stages {
        let cur = stage % 2;
        let has_next = stage + 1 < num_stages;
        if has_next {
            let k_next = (stage + 1) * bk;
            fetch_stage::<F, VA, VB>(
                lhs,
                rhs,
                &mut a_regs,
                &mut b_regs,
                lo,
                ro,
                row0,
                col0,
                m,
                n,
                k_next,
                k,
                tid,
                a_kfast,
                b_nfast,
                threads,
                tile,
            );
        }
        let a_base = cur * a_stage;
        let b_base = cur * b_stage;
        if comptime![manual] {
            mma_stage_manual::<F, VA, VB>(
                &a_s,
                &b_s,
                a_base,
                b_base,
                &mut regs_c,
                prow,
                pcol,
                a_kfast,
                b_nfast,
                tile,
            );
        } else {
            #[unroll]
            for s in 0..comptime!(bk / CMMA_FRAG) {
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
                        cmma::execute::<F, F, f32, f32>(
                            a_frags.index(i),
                            b_frags.index(j),
                            acc,
                            acc,
                        );
                    }
                }
            }
        }
        if has_next {
            let nxt = 1 - cur;
            stash_tile::<F, VA>(
                &a_regs,
                &mut a_s,
                nxt * a_stage,
                tid,
                a_outer,
                a_inner,
                threads,
            );
            stash_tile::<F, VB>(
                &b_regs,
                &mut b_s,
                nxt * b_stage,
                tid,
                b_outer,
                b_inner,
                threads,
            );
        }
        sync_cube();
    }

    // Epilogue, one fragment at a time through this plane's 16×16 f32 scratch.
    let o_off = oo.offset as usize;
    let o_s0 = oo.s0 as usize;
    let o_s1 = oo.s1 as usize;
    let lane = UNIT_POS_X as usize;
    let plane_dim = CUBE_DIM_X as usize;
    let scratch = plane * CMMA_FRAG * CMMA_FRAG;
    let per_lane = comptime!(CMMA_FRAG * CMMA_FRAG) / plane_dim;
    if comptime![manual] {
        store_manual::<F>(
            &regs_c,
            bias,
            bias_off,
            bias_stride,
            out,
            oo,
            row0 + prow,
            col0 + pcol,
            m,
            n,
            has_bias,
            tile,
        );
    } else {
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
                    let row = row0 + prow + i * CMMA_FRAG + idx / CMMA_FRAG;
                    let col = col0 + pcol + j * CMMA_FRAG + idx % CMMA_FRAG;
                    if row < m && col < n {
                        let mut v = c_s[scratch + idx];
                        if comptime![has_bias] {
                            v += f32::cast_from(
                                bias[bias_off as usize + col * bias_stride as usize],
                            );
                        }
                        out[o_off + row * o_s0 + col * o_s1] = F::cast_from(v);
                    }
                }
                sync_cube();
            }
        }
    }
}

/// Both operands' tiles of the stage at K origin `k0` into registers. Each operand is read with
/// its contiguous dimension as the tile's inner one.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_stage<F: Float, VA: Size, VB: Size>(
    lhs: &Tensor<Vector<F, VA>>,
    rhs: &Tensor<Vector<F, VB>>,
    a_regs: &mut Array<Vector<F, VA>>,
    b_regs: &mut Array<Vector<F, VB>>,
    lo: &Operand,
    ro: &Operand,
    row0: usize,
    col0: usize,
    m: usize,
    n: usize,
    k0: usize,
    k: usize,
    tid: usize,
    #[comptime] a_kfast: bool,
    #[comptime] b_nfast: bool,
    #[comptime] threads: usize,
    #[comptime] tile: CmmaTile,
) {
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
#[allow(clippy::too_many_arguments)]
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
#[allow(clippy::too_many_arguments)]
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

/// The accumulators of the manual path: per 16×8 fragment, two f32 pairs per lane, zeroed
/// (none where the kernel is not on the manual path).
#[cube]
pub(crate) fn zero_manual_accumulators(
    #[comptime] tile: CmmaTile,
    #[comptime] manual: bool,
) -> Sequence<Array<Vector<f32, Const<2>>>> {
    let mut regs_c = Sequence::<Array<Vector<f32, Const<2>>>>::new();
    let count = comptime!(if manual {
        tile.bm / tile.pm / CMMA_FRAG * (tile.bn / tile.pn / 8)
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
#[allow(clippy::too_many_arguments)]
pub(crate) fn mma_stage_manual<F: Float, VA: Size, VB: Size>(
    a_s: &SharedMemory<Vector<F, VA>>,
    b_s: &SharedMemory<Vector<F, VB>>,
    a_base: usize,
    b_base: usize,
    regs_c: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    prow: usize,
    pcol: usize,
    #[comptime] a_kfast: bool,
    #[comptime] b_nfast: bool,
    #[comptime] tile: CmmaTile,
) {
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

/// The manual path's epilogue: each lane's accumulators (plus the bias, in f32) rounded once to
/// the output dtype and stored. The plane's block starts at (`row0`, `col0`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_manual<F: Float>(
    regs_c: &Sequence<Array<Vector<f32, Const<2>>>>,
    bias: &Tensor<F>,
    bias_off: u32,
    bias_stride: u32,
    out: &mut Tensor<F>,
    oo: &Operand,
    row0: usize,
    col0: usize,
    m: usize,
    n: usize,
    #[comptime] has_bias: bool,
    #[comptime] tile: CmmaTile,
) {
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
                        out[o_off + row * o_s0 + col * o_s1] = F::cast_from(v);
                    }
                }
            }
        }
    }
}
