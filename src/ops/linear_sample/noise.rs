//! The sampler's noise (docs/CONTRACT.md, *linear_sample semantics*): a counter-based hash of
//! `(seed, row key, vocabulary index)` to a uniform, then `G = −ln(−ln U)` through the portable
//! `ln_p`, so every implementation draws the same bits for the same arguments.
use crate::ops::math::ln_p;

/// Wellons' `lowbias32`: a bijective 32-bit mixer (full avalanche, wrapping arithmetic only).
#[inline]
pub fn mix(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// The row's word: `mix(mix(mix(seed_hi) ^ seed_lo) ^ key)`, the key taken modulo 2³².
#[inline]
pub fn row_word(seed: u64, key: i64) -> u32 {
    let (lo, hi) = (seed as u32, (seed >> 32) as u32);
    mix(mix(mix(hi) ^ lo) ^ key as u32)
}

/// `U = (2·(h >> 9) + 1) · 2⁻²⁴ ∈ (0, 1)` with `h = mix(mix(row ^ v))`; exact in f32.
#[inline]
pub fn uniform(row: u32, v: u32) -> f32 {
    let h = mix(mix(row ^ v));
    (2 * (h >> 9) + 1) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// `G = −ln_p(−ln_p(U))`: standard Gumbel noise, at most [`NOISE_MAX`].
#[inline]
pub fn gumbel(row: u32, v: u32) -> f32 {
    -ln_p(-ln_p(uniform(row, v)))
}

/// An upper bound of [`gumbel`] over every `U` it can draw (checked exhaustively by a test): a
/// logit more than this below the best key so far cannot win, so kernels may skip its noise.
pub const NOISE_MAX: f32 = 16.7;

/// A lower bound of [`gumbel`] likewise: the row's largest logit `m` has a key of at least
/// `m + NOISE_MIN`, so a logit below `m + NOISE_MIN − NOISE_MAX` cannot win either.
pub const NOISE_MIN: f32 = -2.82;

/// The step of [`noise_cap`]: `ln 2` rounded up far enough to cover `ln_p`'s rounding.
pub const NOISE_CAP_STEP: f32 = 0.6932;

/// An upper bound of [`gumbel`]`(row, v)` from the hash bits alone, so that kernels can skip the
/// noise of a logit that cannot win without computing it: with `m = h >> 9` (`U = (2m + 1)·2⁻²⁴`)
/// and `k` the leading ones of `m` as a 23-bit number, `U < 1 − 2^−(k+1)`, so `−ln U > 2^−(k+1)`
/// and `G < (k + 1)·ln 2`; the cap is `(k + 1)·NOISE_CAP_STEP` (checked for every `m` by a test).
#[inline]
pub fn noise_cap(row: u32, v: u32) -> f32 {
    cap_of(mix(mix(row ^ v)) >> 9)
}

/// [`noise_cap`] of the uniform's 23 bits `m`.
#[inline]
fn cap_of(m: u32) -> f32 {
    ((!(m << 9)).leading_zeros() + 1) as f32 * NOISE_CAP_STEP
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_is_bounded_and_gumbel_distributed() {
        // Every uniform the hash can give: m = h >> 9 in [0, 2^23).
        let (mut max, mut min, mut mean) = (f32::NEG_INFINITY, f32::INFINITY, 0.0f64);
        for m in 0u32..1 << 23 {
            let u = (2 * m + 1) as f32 / (1u32 << 24) as f32;
            let g = -ln_p(-ln_p(u));
            assert!(g.is_finite(), "u = {u}");
            max = max.max(g);
            min = min.min(g);
            mean += g as f64;
        }
        mean /= (1u64 << 23) as f64;
        assert!(max <= NOISE_MAX, "max {max}");
        assert!(max > NOISE_MAX - 0.2, "max {max}");
        assert!((NOISE_MIN..NOISE_MIN + 0.02).contains(&min), "min {min}");
        // The Euler–Mascheroni constant.
        assert!((mean - 0.577_215_66).abs() < 1e-4, "mean {mean}");
    }

    #[test]
    fn noise_cap_bounds_every_draw() {
        let mut skippable = 0u64;
        for m in 0u32..1 << 23 {
            let u = (2 * m + 1) as f32 / (1u32 << 24) as f32;
            let g = -ln_p(-ln_p(u));
            let cap = cap_of(m);
            assert!(g <= cap && cap <= NOISE_MAX, "m = {m}: G {g}, cap {cap}");
            skippable += u64::from(cap <= 8.0);
        }
        // The cap is useful: all but the top 2^-11 of the uniforms are capped at 8 or less.
        assert_eq!(skippable, (1 << 23) - (1 << 12), "{skippable}");
        assert_eq!(noise_cap(7, 3), cap_of(mix(mix(7 ^ 3)) >> 9));
    }

    #[test]
    fn uniforms_of_a_row_are_spread_and_rows_differ() {
        let row = row_word(7, 3);
        let bins = 64usize;
        let mut counts = vec![0usize; bins];
        let draws = 1 << 16;
        for v in 0..draws {
            counts[(uniform(row, v) * bins as f32) as usize] += 1;
        }
        let expected = draws as f64 / bins as f64;
        let chi2: f64 = counts
            .iter()
            .map(|&c| (c as f64 - expected).powi(2) / expected)
            .sum();
        // 63 degrees of freedom: p = 1e-6 at about 125.
        assert!(chi2 < 125.0, "chi2 {chi2}");
        assert_ne!(row_word(7, 3), row_word(7, 4));
        assert_ne!(row_word(7, 3), row_word(8, 3));
        assert_ne!(row_word(7, 3), row_word(7 | 1 << 40, 3));
    }
}
