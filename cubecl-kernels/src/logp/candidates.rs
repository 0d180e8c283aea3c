//! The sampler's candidates (`linear_sample`): each unit's best columns under a total order, kept
//! sorted in a short list, offered and stored the same way by the forward's segment kernels and
//! the sampler's own.

use super::noise::{NOISE_MAX, NOISE_MIN, gumbel, noise_cap};
use crate::attention::math::neg_inf;
use cubecl::prelude::*;

/// The bar of [`offer_logit`] for a unit whose largest tempered logit so far is `m` (never NaN).
#[cube]
pub(crate) fn noise_bar(m: f32) -> f32 {
    m + NOISE_MIN
}

/// Vocabulary index of an empty candidate slot; never a token (`V ≤ 2²⁴`) and exact in f32.
pub(crate) const NO_TOKEN: u32 = 1 << 24;
/// f32 words per candidate in the workspace: key, logit, index.
pub(crate) const CANDIDATE: usize = 3;

/// What the candidate code of a kernel keeps: `k = 0` keeps nothing (`linear_logp`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) struct PickCfg {
    pub k: u32,
    pub noise: bool,
    pub emulate_fma: bool,
    /// [`offer`]'s insertion unrolled over the slots (see there) instead of a walk down.
    pub unrolled: bool,
}

impl PickCfg {
    /// No candidates.
    pub(crate) const NONE: Self = Self {
        k: 0,
        noise: false,
        emulate_fma: false,
        unrolled: false,
    };

    /// Slots of the kernels' candidate arrays (at least one, so they always exist).
    pub(crate) const fn slots(&self) -> usize {
        if self.k == 0 { 1 } else { self.k as usize }
    }
}

/// Where the candidates lie in the workspace, and the seed's halves.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct PickScalars {
    pub cand_off: u32,
    pub seed_lo: u32,
    pub seed_hi: u32,
}

/// The candidate scalars of a launch that keeps none.
pub(crate) fn no_pick<R: Runtime>() -> PickScalarsLaunch<R> {
    PickScalarsLaunch::new(0, 0, 0)
}

/// A row's sorted candidates (best first): keys, logits, indices.
#[derive(CubeType)]
pub(crate) struct Candidates {
    pub key: Array<f32>,
    pub z: Array<f32>,
    pub idx: Array<u32>,
}

/// `k` empty slots.
#[cube]
pub(crate) fn empty_candidates(#[comptime] slots: usize) -> Candidates {
    let mut key = Array::<f32>::new(slots);
    let mut z = Array::<f32>::new(slots);
    let mut idx = Array::<u32>::new(slots);
    #[unroll]
    for e in 0..slots {
        key[e] = neg_inf();
        z[e] = neg_inf();
        idx[e] = NO_TOKEN;
    }
    Candidates { key, z, idx }
}

/// Whether `(key, j)` ranks before `(other, oj)`: a larger key, on equal keys the smaller index.
/// A key of −∞ or NaN never ranks.
#[cube]
pub(crate) fn beats(key: f32, j: u32, other: f32, oj: u32) -> bool {
    key > neg_inf() && (key > other || (key == other && j < oj))
}

/// Whether [`offer`] unrolls its insertion on this client: on wgpu. lavapipe's LLVM backend bounds
/// the loop iterations of an invocation, and the walks of a `k = 64` list over a 4096-column
/// segment passed that bound (entries were lost). Elsewhere the walk is faster (top-50 on an H100:
/// 3.5 against 4.1 ms at N = 64).
pub(crate) fn unrolled_insert<R: Runtime>(client: &ComputeClient<R>) -> bool {
    R::name(client).starts_with("wgpu")
}

/// Inserts `(key, z, j)` into the first `k` sorted slots if it ranks before the last; returns
/// whether it did. The order is total, so the list is the same whatever the offering order.
/// `unrolled`: the slot found and the list shifted over every slot with constant indices, no loop;
/// otherwise a walk down from the last slot.
#[cube]
pub(crate) fn offer(
    list: &mut Candidates,
    key: f32,
    z: f32,
    j: u32,
    #[comptime] k: u32,
    #[comptime] unrolled: bool,
) -> bool {
    let last = comptime![k as usize - 1];
    let enters = beats(key, j, list.key[last], list.idx[last]);
    if enters {
        if comptime![unrolled] {
            insert_unrolled(list, key, z, j, k);
        } else {
            // A runtime index (a comptime one would be folded, and `0 - 1` with it).
            let mut p = usize::new(comptime![last as i64]);
            if comptime![k > 1] {
                loop {
                    if p == 0 {
                        break;
                    }
                    if !beats(key, j, list.key[p - 1], list.idx[p - 1]) {
                        break;
                    }
                    list.key[p] = list.key[p - 1];
                    list.z[p] = list.z[p - 1];
                    list.idx[p] = list.idx[p - 1];
                    p -= 1;
                }
            }
            list.key[p] = key;
            list.z[p] = z;
            list.idx[p] = j;
        }
    }
    enters
}

/// [`offer`]'s insertion without a loop, for an entry that ranks before the last slot.
#[cube]
fn insert_unrolled(list: &mut Candidates, key: f32, z: f32, j: u32, #[comptime] k: u32) {
    let last = comptime![k as usize - 1];
    // The new slot: past the entries that rank before it (a prefix: the list is sorted).
    let mut p = usize::new(0);
    #[unroll]
    for e in 0..last {
        if !beats(key, j, list.key[e], list.idx[e]) {
            p += 1;
        }
    }
    // Slots past it move down one, from the last up.
    #[unroll]
    for q in 0..last {
        let e = comptime![last - q];
        let (down, here) = (e > p, e == p);
        list.key[e] = select(down, list.key[e - 1], select(here, key, list.key[e]));
        list.z[e] = select(down, list.z[e - 1], select(here, z, list.z[e]));
        list.idx[e] = select(down, list.idx[e - 1], select(here, j, list.idx[e]));
    }
    let first = p == 0;
    list.key[0] = select(first, key, list.key[0]);
    list.z[0] = select(first, z, list.z[0]);
    list.idx[0] = select(first, j, list.idx[0]);
}

/// `2⁻²²`: twice the relative rounding of an f32.
const CONTRACTION_SLACK: f32 = 2.384_185_8e-7;

/// Offers tempered logit `z` of column `j`: with noise and one slot its Gumbel key (skipped where
/// `z` plus a bound of its noise (`NOISE_MAX`, then the column's [`noise_cap`]) is below the best
/// key or below `bar`, the largest logit seen so far plus `NOISE_MIN`, whose own key is at least
/// that: it could not win), otherwise `z` itself.
#[cube]
pub(crate) fn offer_logit(
    list: &mut Candidates,
    z: f32,
    j: u32,
    row: u32,
    bar: f32,
    #[comptime] pick: PickCfg,
) {
    if comptime![pick.noise && pick.k == 1] {
        let reach = z + NOISE_MAX;
        if reach >= list.key[0] && reach >= bar {
            // The column's own cap (cheap: its hash) skips almost every remaining noise. The
            // slack (at least two units in z's last place) covers a compiler contracting z's
            // product into one of the two sums and not the other.
            let capped = z + noise_cap(row, j) + f32::abs(z) * CONTRACTION_SLACK;
            if capped >= list.key[0] && capped >= bar {
                let key = z + gumbel(row, j, pick.emulate_fma);
                offer(list, key, z, j, 1u32, pick.unrolled);
            }
        }
    } else {
        offer(list, z, z, j, pick.k, pick.unrolled);
    }
}

/// The `k` best of row `row`'s `lists` stored lists (list `l` at candidate slot `l · n + row`),
/// offered list by list.
#[cube]
pub(crate) fn merged_lists(
    ws: &Tensor<f32>,
    cand_off: u32,
    n: usize,
    row: usize,
    lists: usize,
    #[comptime] k: u32,
    #[comptime] unrolled: bool,
) -> Candidates {
    let kk = comptime![k as usize];
    let mut list = empty_candidates(kk);
    for l in 0..lists {
        let o = cand_off as usize + (l * n + row) * kk * CANDIDATE;
        // A flag, not `break`: the inner range is comptime, so the loop is unrolled and a `break`
        // would leave the outer one. A list is sorted: once one entry stays out, the rest do.
        let mut open = true;
        for e in 0..kk {
            let at = o + e * CANDIDATE;
            if open {
                let j = u32::cast_from(ws[at + 2]);
                open = offer(&mut list, ws[at], ws[at + 1], j, k, unrolled);
            }
        }
    }
    list
}

/// Reads a list's `k` slots from candidate slot `slot` (as [`store_candidates`] wrote them).
#[cube]
pub(crate) fn load_candidates(
    ws: &Tensor<f32>,
    cand_off: u32,
    slot: usize,
    list: &mut Candidates,
    #[comptime] k: u32,
) {
    let kk = comptime![k as usize];
    let o = cand_off as usize + slot * kk * CANDIDATE;
    #[unroll]
    for e in 0..kk {
        list.key[e] = ws[o + e * CANDIDATE];
        list.z[e] = ws[o + e * CANDIDATE + 1];
        list.idx[e] = u32::cast_from(ws[o + e * CANDIDATE + 2]);
    }
}

/// Writes a list's `k` slots at candidate slot `slot` (each of `k · CANDIDATE` words).
#[cube]
pub(crate) fn store_candidates(
    ws: &mut Tensor<f32>,
    cand_off: u32,
    slot: usize,
    list: &Candidates,
    #[comptime] k: u32,
) {
    let kk = comptime![k as usize];
    let o = cand_off as usize + slot * kk * CANDIDATE;
    #[unroll]
    for e in 0..kk {
        ws[o + e * CANDIDATE] = list.key[e];
        ws[o + e * CANDIDATE + 1] = list.z[e];
        ws[o + e * CANDIDATE + 2] = f32::cast_from(list.idx[e]);
    }
}
