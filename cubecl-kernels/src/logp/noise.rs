//! The sampler's noise, step for step the Reference's (`src/ops/linear_sample/noise.rs`): a
//! counter-based hash of `(seed, row key, vocabulary index)` in wrapping u32 arithmetic, a
//! uniform exact in f32, and `G = −ln_p(−ln_p(U))` through the portable `ln_p`.

use crate::attention::math::{c, ln_p};
use cubecl::prelude::*;

/// `2⁻²⁴`.
const TWO_POW_M24: u32 = 0x3380_0000;

/// A bound of the noise over every uniform it can draw (the Reference's `NOISE_MAX`, tested
/// exhaustively there): a logit this far below the best key cannot win.
pub(crate) const NOISE_MAX: f32 = 16.7;

/// A lower bound of the noise likewise (the Reference's `NOISE_MIN`): the largest logit's key is at
/// least that logit plus this.
pub(crate) const NOISE_MIN: f32 = -2.82;

/// The step of [`noise_cap`] (the Reference's `NOISE_CAP_STEP`).
const NOISE_CAP_STEP: f32 = 0.6932;

/// An upper bound of [`gumbel`]`(row, j)` from the hash bits alone (the Reference's `noise_cap`,
/// checked against every uniform there): `(k + 1)·NOISE_CAP_STEP` for `k` the leading ones of
/// the uniform's 23 bits. Lets the kernels skip the noise of a logit that cannot win.
#[cube]
pub(crate) fn noise_cap(row: u32, j: u32) -> f32 {
    let m = mix(mix(row ^ j)) >> 9u32;
    f32::cast_from(u32::leading_zeros(!(m << 9u32)) + 1u32) * NOISE_CAP_STEP
}

/// Wellons' `lowbias32`.
#[cube]
pub(crate) fn mix(x: u32) -> u32 {
    let mut h = x ^ (x >> 16u32);
    h *= 0x7feb_352du32;
    h ^= h >> 15u32;
    h *= 0x846c_a68bu32;
    h ^ (h >> 16u32)
}

/// The row's word from the seed's halves and the row's key (modulo 2³²).
#[cube]
pub(crate) fn row_word(seed_lo: u32, seed_hi: u32, key: u32) -> u32 {
    mix(mix(mix(seed_hi) ^ seed_lo) ^ key)
}

/// Gumbel noise of vocabulary index `j` in the row whose word is `row`.
#[cube]
pub(crate) fn gumbel(row: u32, j: u32, #[comptime] emulate: bool) -> f32 {
    let h = mix(mix(row ^ j));
    let u = f32::cast_from(2u32 * (h >> 9u32) + 1u32) * c(TWO_POW_M24);
    -ln_p(-ln_p(u, emulate), emulate)
}
