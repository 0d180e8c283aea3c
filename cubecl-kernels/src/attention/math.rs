//! The portable exponential and logarithm of the attention contract (docs/CONTRACT.md,
//! *attention semantics*), step for step the Reference's `exp_p` / `ln_p`
//! (`src/ops/math.rs`): only operations that every backend rounds the same way (`fma` through
//! `fma_f32`, `floor`, comparisons, exact power-of-two products), constants given by their
//! bit patterns, `2ⁿ` built from its bits.

use crate::gemm::fma::fma_f32;
use cubecl::prelude::*;

/// `log2(e)`.
const LOG2E: u32 = 0x3fb8_aa3b;
/// `ln 2` split: the high part has 16 significant bits.
const LN2_HI: u32 = 0x3f31_7200;
/// `ln 2 − LN2_HI`.
const LN2_LO: u32 = 0x35bf_be8e;
/// `√2`.
const SQRT_2: u32 = 0x3fb5_04f3;
/// `−86`: below this `exp_p` is 0.
const EXP_LOW: u32 = 0xc2ac_0000;
/// `88`: above this `exp_p` is +∞.
const EXP_HIGH: u32 = 0x42b0_0000;
/// `+∞`.
const INF: u32 = 0x7f80_0000;
/// `−∞`.
const NEG_INF: u32 = 0xff80_0000;

/// `1/k!` for k = 0..=7, as f32 (Horner from k = 7 down).
const EXP_TAYLOR: [u32; 8] = [
    0x3f80_0000,
    0x3f80_0000,
    0x3f00_0000,
    0x3e2a_aaab,
    0x3d2a_aaab,
    0x3c08_8889,
    0x3ab6_0b61,
    0x3950_0d01,
];

/// `(−1)^(k+1)/k` for k = 1..=17, as f32 (`ln(1 + u) = u·Σ c_k·u^(k−1)`).
const LN_TAYLOR: [u32; 17] = [
    0x3f80_0000,
    0xbf00_0000,
    0x3eaa_aaab,
    0xbe80_0000,
    0x3e4c_cccd,
    0xbe2a_aaab,
    0x3e12_4925,
    0xbe00_0000,
    0x3de3_8e39,
    0xbdcc_cccd,
    0x3dba_2e8c,
    0xbdaa_aaab,
    0x3d9d_89d9,
    0xbd92_4925,
    0x3d88_8889,
    0xbd80_0000,
    0x3d70_f0f1,
];

/// The bits of `2ᵏ` (`k` in `[-126, 127]`).
const fn pow2_bits(k: i32) -> u32 {
    ((k + 127) as u32) << 23
}

/// An f32 constant from its bits. The bits are or-ed with the runtime zero `CUBE_POS_Z` (every
/// attention launch has one cube along z), so the reinterpret never takes a literal: CUDA's
/// `reinterpret_cast` cannot take one, and a folded float literal could not spell ±∞.
#[cube]
pub(crate) fn c(#[comptime] bits: u32) -> f32 {
    f32::reinterpret(bits | CUBE_POS_Z)
}

/// `−∞`.
#[cube]
pub(crate) fn neg_inf() -> f32 {
    c(NEG_INF)
}

/// `e^x` by the hardware exponential (`__expf`: `ex2.approx` of `x·log2 e`); 0 for −∞. The
/// tensor-core forward's exponential (not portable: a fixed function of `x` on a device).
#[cube(fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
pub(crate) fn fast_exp(x: f32) -> f32 {
    f32::exp(x)
}

/// `eˣ` as the Reference's `exp_p`: 0 below −86 (−∞ included), +∞ above 88, NaN for NaN;
/// otherwise `n = floor(fma(x, log2 e, 0.5))`, `r = fma(−n, LN2_HI, x)`,
/// `r = fma(−n, LN2_LO, r)`, the degree-7 Taylor polynomial by Horner's rule in `fma`, times `2ⁿ`
/// (built from its bits; `n ∈ [−124, 127]` on this range, so the product is exact).
#[cube]
pub fn exp_p(x: f32, #[comptime] emulate: bool) -> f32 {
    let low = c(EXP_LOW);
    let high = c(EXP_HIGH);
    // False for NaN: the polynomial then runs on 0 and the NaN is returned below.
    let ok = x >= low && x <= high;
    let xr = select(ok, x, 0.0f32);
    let n = f32::floor(fma_f32(xr, c(LOG2E), 0.5f32, emulate));
    let r = fma_f32(-n, c(LN2_HI), xr, emulate);
    let r = fma_f32(-n, c(LN2_LO), r, emulate);
    let mut p = c(comptime![EXP_TAYLOR[7]]);
    p = fma_f32(p, r, c(comptime![EXP_TAYLOR[6]]), emulate);
    p = fma_f32(p, r, c(comptime![EXP_TAYLOR[5]]), emulate);
    p = fma_f32(p, r, c(comptime![EXP_TAYLOR[4]]), emulate);
    p = fma_f32(p, r, c(comptime![EXP_TAYLOR[3]]), emulate);
    p = fma_f32(p, r, c(comptime![EXP_TAYLOR[2]]), emulate);
    p = fma_f32(p, r, c(comptime![EXP_TAYLOR[1]]), emulate);
    p = fma_f32(p, r, c(comptime![EXP_TAYLOR[0]]), emulate);
    let two_n = f32::reinterpret(u32::cast_from(i32::cast_from(n) + 127i32) << 23u32);
    let v = p * two_n;
    select(x < low, 0.0f32, select(x > high, c(INF), select(ok, v, x)))
}

/// One step of the downward scaling: `f ≥ 2ᵏ` → `f·2⁻ᵏ`, `e + k`.
#[cube]
fn scale_down(f: &mut f32, e: &mut i32, #[comptime] k: i32) {
    let hit = *f >= c(comptime![pow2_bits(k)]);
    *f = select(hit, *f * c(comptime![pow2_bits(-k)]), *f);
    *e = select(hit, *e + k, *e);
}

/// One step of the upward scaling: `f < 2^(1−k)` → `f·2ᵏ`, `e − k`.
#[cube]
fn scale_up(f: &mut f32, e: &mut i32, #[comptime] k: i32) {
    let hit = *f < c(comptime![pow2_bits(1 - k)]);
    *f = select(hit, *f * c(comptime![pow2_bits(k)]), *f);
    *e = select(hit, *e - k, *e);
}

/// `ln x` as the Reference's `ln_p` (finite `x > 0`; other inputs get what the same arithmetic
/// gives): `x = 2ᵉ·f`, `f ∈ [√½, √2]`, by exact power-of-two scalings (64, 32, .., 1 down, then
/// up), `u = f − 1`, `Q(u)` the degree-16 polynomial of `ln(1 + u)/u` by Horner's rule in `fma`,
/// `fma(e, LN2_HI, fma(e, LN2_LO, u·Q(u)))`.
#[cube]
pub fn ln_p(x: f32, #[comptime] emulate: bool) -> f32 {
    let mut f = x;
    let mut e = 0i32;
    scale_down(&mut f, &mut e, 64);
    scale_down(&mut f, &mut e, 32);
    scale_down(&mut f, &mut e, 16);
    scale_down(&mut f, &mut e, 8);
    scale_down(&mut f, &mut e, 4);
    scale_down(&mut f, &mut e, 2);
    scale_down(&mut f, &mut e, 1);
    scale_up(&mut f, &mut e, 64);
    scale_up(&mut f, &mut e, 32);
    scale_up(&mut f, &mut e, 16);
    scale_up(&mut f, &mut e, 8);
    scale_up(&mut f, &mut e, 4);
    scale_up(&mut f, &mut e, 2);
    scale_up(&mut f, &mut e, 1);
    let big = f > c(SQRT_2);
    f = select(big, f * 0.5f32, f);
    e = select(big, e + 1i32, e);
    let u = f - 1.0f32;
    let mut q = c(comptime![LN_TAYLOR[16]]);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[15]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[14]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[13]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[12]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[11]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[10]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[9]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[8]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[7]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[6]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[5]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[4]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[3]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[2]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[1]]), emulate);
    q = fma_f32(q, u, c(comptime![LN_TAYLOR[0]]), emulate);
    let ef = f32::cast_from(e);
    fma_f32(
        ef,
        c(LN2_HI),
        fma_f32(ef, c(LN2_LO), u * q, emulate),
        emulate,
    )
}

/// The float next to a finite `x > 0`, one ulp up (`up`) or down.
#[cube]
fn step_ulp(x: f32, up: bool) -> f32 {
    let bits = u32::reinterpret(x);
    f32::reinterpret(select(up, bits + 1u32, bits - 1u32))
}

/// `a / b` correctly rounded (IEEE) from any division within a few ulps: Vulkan allows its
/// division 2.5 ulps, CUDA and CPUs round it correctly, and the contract's `/` is IEEE's.
/// The significands are divided (`[1, 2) / [1, 2)`, where every residual below is a normal
/// float and no product overflows) and the exponents added back exactly; normal operands and
/// results, other inputs (zeros, subnormals, ∞, NaN included) keep the division's own result.
#[cube]
pub fn div_rn(a: f32, b: f32, #[comptime] emulate: bool) -> f32 {
    let q0 = a / b;
    let (ba, bb) = (u32::reinterpret(a), u32::reinterpret(b));
    let bq = u32::reinterpret(significand_quotient(
        significand(ba),
        significand(bb),
        emulate,
    ));
    let e = exponent(bq) + exponent(ba) - exponent(bb);
    let normal = is_normal(ba) && is_normal(bb) && normal_exponent(e);
    let sign = (ba ^ bb) & 0x8000_0000u32;
    let bits = (bq & 0x007f_ffffu32) | (u32::cast_from(e) << 23u32) | sign;
    select(normal, f32::reinterpret(bits), q0)
}

/// `1 / b` correctly rounded: [`div_rn()`] with the numerator's fields written out (significand
/// 1, biased exponent 127, sign +). A numerator given as the literal `1.0` would reach CUDA as a
/// `reinterpret_cast` of a literal, which NVRTC rejects.
#[cube]
pub fn recip_rn(b: f32, #[comptime] emulate: bool) -> f32 {
    let q0 = 1.0f32 / b;
    let bb = u32::reinterpret(b);
    let bq = u32::reinterpret(significand_quotient(1.0f32, significand(bb), emulate));
    let e = exponent(bq) + 127i32 - exponent(bb);
    let normal = is_normal(bb) && normal_exponent(e);
    let bits = (bq & 0x007f_ffffu32) | (u32::cast_from(e) << 23u32) | (bb & 0x8000_0000u32);
    select(normal, f32::reinterpret(bits), q0)
}

/// The biased exponent field of `bits`.
#[cube]
fn exponent(bits: u32) -> i32 {
    i32::cast_from((bits >> 23u32) & 0xffu32)
}

/// Finite, nonzero and not subnormal.
#[cube]
fn is_normal(bits: u32) -> bool {
    normal_exponent(exponent(bits))
}

/// A biased exponent of a normal float.
#[cube]
#[allow(clippy::manual_range_contains)] // #[cube] cannot expand `RangeInclusive::contains`
fn normal_exponent(e: i32) -> bool {
    e >= 1i32 && e <= 254i32
}

/// The significand of `bits` as a float in `[1, 2)`.
#[cube]
fn significand(bits: u32) -> f32 {
    f32::reinterpret((bits & 0x007f_ffffu32) | 0x3f80_0000u32)
}

/// `sa / sb` correctly rounded for `sa, sb ∈ [1, 2)`: one fma step from the device's quotient,
/// then each correction step (`quotient_step`) moves it at most one ulp towards the rounded
/// quotient; once `q` is faithful `r = a − b·q` is exact and the step is exact (a quotient of
/// floats never lies on a midpoint), so two steps also cover a first step that was not faithful.
#[cube]
fn significand_quotient(sa: f32, sb: f32, #[comptime] emulate: bool) -> f32 {
    let q0 = sa / sb;
    let mut q = fma_f32(fma_f32(-sb, q0, sa, emulate), 1.0f32 / sb, q0, emulate);
    #[unroll]
    for _ in 0..DIV_STEPS {
        q = quotient_step(sa, sb, q, emulate);
    }
    q
}

/// Correction steps of [`div_rn`].
const DIV_STEPS: u32 = 2;

/// `q`, or the float above or below it, whichever the residual `r = a − b·q` says is nearer to
/// `a / b` (`a, b, q > 0`): above when `r > b·(q⁺ − q)/2`, below when `r < −b·(q − q⁻)/2`.
#[cube]
fn quotient_step(sa: f32, sb: f32, q: f32, #[comptime] emulate: bool) -> f32 {
    let up = step_ulp(q, true);
    let down = step_ulp(q, false);
    let r = fma_f32(-sb, q, sa, emulate);
    let m = select(r > sb * ((up - q) * 0.5f32), up, q);
    select(r < -(sb * ((q - down) * 0.5f32)), down, m)
}

/// `√x` correctly rounded (IEEE) from any square root within a few ulps (Vulkan's is not
/// IEEE). The root is taken of `x`'s significand scaled into `[1, 4)` (an even exponent left
/// over, halved exactly): for a candidate `s`, `m − s·s⁺` and `m − s·s⁻` are multiples of
/// `ulp(s)²/4` (normal floats there) and the squares of the midpoints sit a quarter of
/// `ulp(s)²` above them, so the signs of two fmas say exactly whether `√m` lies within `s`'s
/// rounding interval; each step moves `s` one ulp. Normal `x > 0`; other inputs keep the
/// device's root.
#[cube]
pub fn sqrt_rn(x: f32, #[comptime] emulate: bool) -> f32 {
    let s0 = f32::sqrt(x);
    let bits = u32::reinterpret(x);
    // An odd unbiased exponent (an even biased one) moves one factor 2 into the significand.
    let m_exp = select((bits & 0x0080_0000u32) == 0u32, 128u32, 127u32);
    let m = f32::reinterpret((bits & 0x007f_ffffu32) | (m_exp << 23u32));
    let mut s = f32::sqrt(m);
    #[unroll]
    for _ in 0..SQRT_STEPS {
        let up = step_ulp(s, true);
        let down = step_ulp(s, false);
        let low = fma_f32(-s, up, m, emulate) > 0.0f32;
        let high = fma_f32(-s, down, m, emulate) <= 0.0f32;
        s = select(low, up, select(high, down, s));
    }
    // Half the even exponent left over, by an exact division (no signed shift).
    let half = (exponent(bits) - i32::cast_from(m_exp)) / 2i32;
    let root = f32::reinterpret(u32::cast_from(
        i32::cast_from(u32::reinterpret(s)) + half * 8_388_608i32,
    ));
    select(is_normal(bits) && x > 0.0f32, root, s0)
}

/// Ulp steps of [`sqrt_rn`]: more than the error of any device's root.
const SQRT_STEPS: u32 = 4;

/// `out[i] = exp_p(x[i])`, `out[n + i] = ln_p(x[i])`, `out[2n + i] = div_rn(x[i], x[i + 1])`
/// (`x[0]` after the last), `out[3n + i] = sqrt_rn(|x[i]|)`, `out[4n + i] = recip_rn(x[i])`, for
/// testing the device functions.
#[cube(launch_unchecked)]
pub(crate) fn math_probe_kernel(x: &Array<f32>, out: &mut Array<f32>, #[comptime] emulate: bool) {
    let i = ABSOLUTE_POS;
    let n = x.len();
    if i < n {
        out[i] = exp_p(x[i], emulate);
        out[n + i] = ln_p(x[i], emulate);
        out[2 * n + i] = div_rn(x[i], x[(i + 1) % n], emulate);
        out[3 * n + i] = sqrt_rn(f32::abs(x[i]), emulate);
        out[4 * n + i] = recip_rn(x[i], emulate);
    }
}

/// The correction algorithms of [`div_rn`] and [`sqrt_rn`] on the CPU, fed device results that
/// are off by a few ulps (what a driver's `/`, reciprocal or `sqrt` may give): the corrected
/// value must be IEEE's whatever the error. Step for step the kernels above, with the device
/// operations replaced by perturbed IEEE ones.
#[cfg(test)]
mod tests {
    fn ulps(x: f32, k: i32) -> f32 {
        f32::from_bits((x.to_bits() as i32 + k) as u32)
    }

    fn quotient_step(sa: f32, sb: f32, q: f32) -> f32 {
        let (up, down) = (ulps(q, 1), ulps(q, -1));
        let r = (-sb).mul_add(q, sa);
        let m = if r > sb * ((up - q) * 0.5) { up } else { q };
        if r < -(sb * ((q - down) * 0.5)) {
            down
        } else {
            m
        }
    }

    fn exponent(x: f32) -> i32 {
        ((x.to_bits() >> 23) & 0xff) as i32
    }

    fn significand(x: f32) -> f32 {
        f32::from_bits((x.to_bits() & 0x007f_ffff) | 0x3f80_0000)
    }

    /// `div_rn` with the device's quotient (`dq` ulps off) and reciprocal (`dr`) of the
    /// significands.
    fn div_rn(a: f32, b: f32, dq: i32, dr: i32) -> f32 {
        let (sa, sb) = (significand(a), significand(b));
        let q0 = ulps(sa / sb, dq);
        let mut q = (-sb).mul_add(q0, sa).mul_add(ulps(1.0 / sb, dr), q0);
        for _ in 0..super::DIV_STEPS {
            q = quotient_step(sa, sb, q);
        }
        let e = exponent(q) + exponent(a) - exponent(b);
        let normal = a.is_normal() && b.is_normal() && (1..=254).contains(&e);
        let sign = (a.to_bits() ^ b.to_bits()) & 0x8000_0000;
        if normal {
            f32::from_bits((q.to_bits() & 0x007f_ffff) | ((e as u32) << 23) | sign)
        } else {
            a / b
        }
    }

    /// `sqrt_rn` with the device's root of the significand `ds` ulps off.
    fn sqrt_rn(x: f32, ds: i32) -> f32 {
        let e = exponent(x) - 127;
        let odd = e & 1 != 0;
        let m = f32::from_bits((x.to_bits() & 0x007f_ffff) | (if odd { 128 } else { 127 } << 23));
        let mut s = ulps(m.sqrt(), ds);
        for _ in 0..super::SQRT_STEPS {
            let (up, down) = (ulps(s, 1), ulps(s, -1));
            let low = (-s).mul_add(up, m) > 0.0;
            let high = (-s).mul_add(down, m) <= 0.0;
            s = if low {
                up
            } else if high {
                down
            } else {
                s
            };
        }
        let half = (e - odd as i32) >> 1;
        f32::from_bits((s.to_bits() as i32 + (half << 23)) as u32)
    }

    /// splitmix64.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        /// A normal float of either sign with exponent in `[-e, e]`.
        fn float(&mut self, e: i32) -> f32 {
            let v = self.next();
            let exp = (v % (2 * e as u64 + 1)) as i32 - e;
            let bits = (((exp + 127) as u32) << 23) | ((v >> 32) as u32 & 0x007f_ffff);
            let x = f32::from_bits(bits);
            if v & (1 << 20) != 0 { -x } else { x }
        }
    }

    #[test]
    fn div_rn_is_ieee_from_a_quotient_a_few_ulps_off() {
        let mut rng = Rng(7);
        let mut checked = 0u64;
        for i in 0..200_000 {
            let b = rng.float(125);
            // Half the pairs put `a / b` next to a midpoint of two floats: the hard cases.
            let a = if i % 2 == 0 {
                rng.float(125)
            } else {
                let q = rng.float(125).abs();
                let mid = (q as f64 + ulps(q, 1) as f64) / 2.0;
                (b as f64 * mid) as f32
            };
            let want = a / b;
            if !(a.is_normal() && b.is_normal() && want.is_normal()) {
                continue;
            }
            for dq in -3..=3 {
                for dr in -2..=2 {
                    let got = div_rn(a, b, dq, dr);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{a:e} / {b:e}: quotient {dq} ulps, reciprocal {dr} ulps off"
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked > 1_000_000, "{checked} cases");
    }

    #[test]
    fn sqrt_rn_is_ieee_from_a_root_a_few_ulps_off() {
        let mut rng = Rng(11);
        for i in 0..200_000 {
            // Every other `x` the square of a midpoint, rounded: the hard cases.
            let x = if i % 2 == 0 {
                rng.float(126).abs()
            } else {
                let s = rng.float(63).abs();
                let mid = (s as f64 + ulps(s, 1) as f64) / 2.0;
                (mid * mid) as f32
            };
            if !x.is_normal() {
                continue;
            }
            let want = x.sqrt();
            for ds in -3..=3 {
                let got = sqrt_rn(x, ds);
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "sqrt({x:e}), root {ds} ulps off"
                );
            }
        }
    }
}
