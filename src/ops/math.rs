//! The portable exponential and logarithm of the attention contract (docs/CONTRACT.md,
//! *attention semantics*): only IEEE operations that every backend rounds the same way (`fma`,
//! `floor`, comparisons, exact power-of-two scalings), so the Reference and the CubeCL kernels
//! (`burn_invariant_cubecl::attention::math`, the same steps) give the same bits.

/// `log2(e)`.
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split: the high part has 16 significant bits, so `n · LN2_HI` is exact for `|n| < 2⁸`.
pub(crate) const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
/// `ln 2 − LN2_HI`.
pub(crate) const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
/// Below this `exp_p` is 0 (the result would leave the normal range).
pub(crate) const EXP_LOW: f32 = -86.0;
/// Above this `exp_p` is +∞.
pub(crate) const EXP_HIGH: f32 = 88.0;

/// `1/k!` for k = 0..=7, as f32.
const EXP_TAYLOR: [f32; 8] = [
    1.0,
    1.0,
    0.5,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
    1.0 / 5040.0,
];

/// `2ⁿ` for `n` in `[-126, 127]`, exact.
const fn pow2(n: i32) -> f32 {
    f32::from_bits(((n + 127) as u32) << 23)
}

/// `eˣ`: 0 below [`EXP_LOW`], +∞ above [`EXP_HIGH`], NaN for NaN; otherwise Cody–Waite
/// reduction and the degree-7 Taylor polynomial (a relative error of about 1e-7).
pub(crate) fn exp_p(x: f32) -> f32 {
    if x < EXP_LOW {
        return 0.0;
    }
    if x > EXP_HIGH {
        return f32::INFINITY;
    }
    if x.is_nan() {
        return x;
    }
    let n = x.mul_add(LOG2E, 0.5).floor();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = EXP_TAYLOR[7];
    for k in (0..7).rev() {
        p = p.mul_add(r, EXP_TAYLOR[k]);
    }
    p * pow2(n as i32)
}

/// `(1/k)·(−1)^(k+1)` for k = 1..=17: `ln(1 + u) = u·Σ c_k·u^(k−1)`.
const fn ln_coefficient(k: usize) -> f32 {
    let c = 1.0 / k as f32;
    if k.is_multiple_of(2) { -c } else { c }
}

const LN_TAYLOR: [f32; 17] = {
    let mut c = [0.0f32; 17];
    let mut k = 0;
    while k < 17 {
        c[k] = ln_coefficient(k + 1);
        k += 1;
    }
    c
};

/// Steps of the power-of-two scaling: `(k, 2ᵏ, 2⁻ᵏ)`.
const SCALE_STEPS: [(i32, f32, f32); 7] = [
    (64, pow2(64), pow2(-64)),
    (32, pow2(32), pow2(-32)),
    (16, pow2(16), pow2(-16)),
    (8, pow2(8), pow2(-8)),
    (4, pow2(4), pow2(-4)),
    (2, pow2(2), pow2(-2)),
    (1, pow2(1), pow2(-1)),
];

/// `ln x` for finite `x > 0` (NaN, ±∞ and `x ≤ 0` give what the arithmetic gives; attention
/// only takes it of a softmax sum ≥ 1): `x = 2ᵉ·f` with `f ∈ [√½, √2]` by exact scalings, then
/// the degree-17 Taylor polynomial of `ln(1 + u)`, `u = f − 1` (absolute error about 1e-8).
pub(crate) fn ln_p(x: f32) -> f32 {
    let (mut f, mut e) = (x, 0i32);
    for (k, up, down) in SCALE_STEPS {
        if f >= up {
            f *= down;
            e += k;
        }
    }
    for (k, up, down) in SCALE_STEPS {
        // `2^(1−k)`: after this step `f ≥ 2^(1−k)·…`, ending in [1, 2).
        if f < down * 2.0 {
            f *= up;
            e -= k;
        }
    }
    if f > std::f32::consts::SQRT_2 {
        f *= 0.5;
        e += 1;
    }
    let u = f - 1.0;
    let mut q = LN_TAYLOR[16];
    for k in (0..16).rev() {
        q = q.mul_add(u, LN_TAYLOR[k]);
    }
    let ef = e as f32;
    ef.mul_add(LN2_HI, ef.mul_add(LN2_LO, u * q))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_p_is_close_to_exp() {
        let mut worst = 0.0f64;
        for i in 0..200_000 {
            let x = -86.0 + 174.0 * (i as f32 / 200_000.0);
            let (got, want) = (exp_p(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 4e-7, "relative error {worst}");
        assert_eq!(exp_p(0.0), 1.0);
        assert_eq!(exp_p(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_p(-86.5), 0.0);
        assert_eq!(exp_p(89.0), f32::INFINITY);
        assert!(exp_p(f32::NAN).is_nan());
    }

    #[test]
    fn ln_p_is_close_to_ln() {
        let mut worst = 0.0f64;
        let mut x = 1e-30f32;
        while x < 1e30 {
            let (got, want) = (ln_p(x) as f64, (x as f64).ln());
            worst = worst.max((got - want).abs() / want.abs().max(1.0));
            x *= 1.0137;
        }
        assert!(worst < 4e-7, "error {worst}");
        assert_eq!(ln_p(1.0), 0.0);
    }
}
