//! The Reference arithmetic of `linear_logp` on host slices. Each output element is one `f32::mul_add` chain in
//! ascending reduction order, so a row's bits never depend on other rows; rayon only spreads
//! independent outputs over threads.
use rayon::prelude::*;

/// Vocabulary tile of the reference online softmax. The reference's bits depend on it, so it
/// is fixed.
pub const VOCAB_TILE: usize = 256;

/// Max that propagates NaN (`f32::max` drops it).
#[inline]
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// Running softmax statistics of one row: max, sum of `exp(z − max)`, and sum of
/// `exp(z − max)·(z − max)` (for the entropy).
#[derive(Debug, Clone, Copy)]
struct Softmax {
    max: f32,
    sum: f32,
    shifted: f32,
}

impl Softmax {
    const EMPTY: Self = Self {
        max: f32::NEG_INFINITY,
        sum: 0.0,
        shifted: 0.0,
    };

    fn of_tile(z: &[f32]) -> Self {
        let max = z.iter().copied().fold(f32::NEG_INFINITY, nan_max);
        // A tile of -inf logits (masked vocabulary) contributes nothing.
        if max == f32::NEG_INFINITY {
            return Self::EMPTY;
        }
        let (mut sum, mut shifted) = (0.0f32, 0.0f32);
        for &v in z {
            let e = (v - max).exp();
            sum += e;
            // e = 0 also covers −∞ logits, whose (v − max) would make 0·∞.
            if e != 0.0 {
                shifted += e * (v - max);
            }
        }
        Self { max, sum, shifted }
    }

    fn merge(self, other: Self) -> Self {
        let max = nan_max(self.max, other.max);
        if max == f32::NEG_INFINITY {
            return Self::EMPTY;
        }
        let scale = |part: Self| (part.max - max).exp();
        let sum = self.sum * scale(self) + other.sum * scale(other);
        let shift = |part: Self| {
            if part.sum == 0.0 {
                0.0
            } else {
                scale(part) * (part.shifted + (part.max - max) * part.sum)
            }
        };
        Self {
            max,
            sum,
            shifted: shift(self) + shift(other),
        }
    }

    /// `(lse, entropy)`: `lse = max + ln(sum)`, `H = ln(sum) − shifted / sum`.
    fn finish(self) -> (f32, f32) {
        let ls = self.sum.ln();
        (self.max + ls, ls - self.shifted / self.sum)
    }
}

/// Problem description of the reference `linear_logp`.
#[derive(Debug, Clone, Copy)]
pub struct LogpProblem<'a> {
    /// `[N, D]` row-major.
    pub hidden: &'a [f32],
    /// `[V, D]` row-major.
    pub weight: &'a [f32],
    /// `[V]`.
    pub bias: Option<&'a [f32]>,
    /// `[N]`.
    pub targets: &'a [i64],
    /// Rows whose target equals this are ignored.
    pub ignore_index: Option<i64>,
    /// Rows.
    pub n: usize,
    /// Hidden size.
    pub d: usize,
    /// Vocabulary size.
    pub v: usize,
    /// `1 / T`: the logits are `(hidden · weightᵀ + bias) · inv_temperature`.
    pub inv_temperature: f32,
    /// Whether the statistics carry the entropy column.
    pub entropy: bool,
}

/// A row's upstream gradients, with `logp` and `entropy` dropped for ignored rows.
#[derive(Debug, Clone, Copy)]
struct RowGrad {
    logp: f32,
    lse: f32,
    entropy: f32,
}

impl RowGrad {
    /// All zero: the row contributes exactly nothing (even with NaN / Inf activations).
    fn is_zero(&self) -> bool {
        self.logp == 0.0 && self.lse == 0.0 && self.entropy == 0.0
    }
}

impl LogpProblem<'_> {
    /// Columns of the statistics and of the upstream gradient.
    pub fn columns(&self) -> usize {
        2 + usize::from(self.entropy)
    }

    /// `z[i, j]`: one ascending `mul_add` chain over D, then the bias, then `· 1/T`.
    #[inline]
    pub(crate) fn logit(&self, i: usize, j: usize) -> f32 {
        let h = &self.hidden[i * self.d..(i + 1) * self.d];
        let w = &self.weight[j * self.d..(j + 1) * self.d];
        let dot = h
            .iter()
            .zip(w)
            .fold(0.0f32, |acc, (a, b)| a.mul_add(*b, acc));
        let raw = match self.bias {
            Some(bias) => dot + bias[j],
            None => dot,
        };
        raw * self.inv_temperature
    }

    fn is_ignored(&self, i: usize) -> bool {
        self.ignore_index == Some(self.targets[i])
    }

    /// The target as a vocabulary index, if it is one.
    fn target(&self, i: usize) -> Option<usize> {
        usize::try_from(self.targets[i])
            .ok()
            .filter(|&t| t < self.v)
    }

    /// `∂L/∂logit[i, j]` from the tempered logit `z` and row i's saved `(lse, entropy)`.
    #[inline]
    fn dlogit(&self, z: f32, lse: f32, entropy: f32, g: RowGrad, is_target: bool) -> f32 {
        let p = (z - lse).exp();
        let mut dz = (g.lse - g.logp) * p;
        if is_target {
            dz += g.logp;
        }
        // p = 0 (a −∞ logit) adds nothing, where (z − lse) would make 0·∞.
        if self.entropy && p != 0.0 {
            dz -= g.entropy * (p * ((z - lse) + entropy));
        }
        dz * self.inv_temperature
    }

    /// Row i's saved `(lse, entropy)` and upstream gradients.
    fn row(&self, i: usize, stats: &[f32], grad: &[f32]) -> (f32, f32, RowGrad) {
        let c = self.columns();
        let ignored = self.is_ignored(i);
        let drop = |x: f32| if ignored { 0.0 } else { x };
        let entropy = if self.entropy { stats[c * i + 2] } else { 0.0 };
        let g = RowGrad {
            logp: drop(grad[c * i]),
            lse: grad[c * i + 1],
            entropy: if self.entropy {
                drop(grad[c * i + 2])
            } else {
                0.0
            },
        };
        (stats[c * i + 1], entropy, g)
    }
}

/// Forward: `[N, C]` with `(logp, lse[, entropy])` per row. The vocabulary is walked in
/// [`VOCAB_TILE`]-wide tiles in ascending order; only one tile of logits exists at a time.
/// A target that is neither in range nor ignored yields NaN (the public API rejects those).
/// Ignored rows get `logp = 0` and `entropy = 0`.
///
/// # Panics
/// When a slice of `problem` is shorter than `n`, `d`, `v` say.
pub fn linear_logp(problem: &LogpProblem<'_>) -> Vec<f32> {
    let c = problem.columns();
    let mut out = vec![0.0f32; c * problem.n];
    out.par_chunks_mut(c).enumerate().for_each(|(i, stats)| {
        let mut tile = vec![0.0f32; VOCAB_TILE.min(problem.v)];
        let mut softmax = Softmax::EMPTY;
        let mut target_logit = f32::NAN;
        let target = problem.target(i);
        for start in (0..problem.v).step_by(VOCAB_TILE) {
            let end = (start + VOCAB_TILE).min(problem.v);
            let z = &mut tile[..end - start];
            for (offset, slot) in z.iter_mut().enumerate() {
                *slot = problem.logit(i, start + offset);
            }
            if let Some(t) = target.filter(|t| (start..end).contains(t)) {
                target_logit = z[t - start];
            }
            softmax = softmax.merge(Softmax::of_tile(z));
        }
        let (lse, entropy) = softmax.finish();
        let ignored = problem.is_ignored(i);
        stats[0] = if ignored { 0.0 } else { target_logit - lse };
        stats[1] = lse;
        if problem.entropy {
            stats[2] = if ignored { 0.0 } else { entropy };
        }
    });
    out
}

/// `(dHidden, dWeight, dBias)` on the host, each present when requested.
pub type HostGrads = (Option<Vec<f32>>, Option<Vec<f32>>, Option<Vec<f32>>);

/// Backward from `stats [N, C]` (lse in column 1, entropy in column 2) and `grad [N, C]`
/// (`dLogp`, `dLse[, dEntropy]`). `dHidden[i]` sums over the vocabulary in ascending order;
/// `dWeight[j]` and `dBias[j]` sum over tokens in ascending order, skipping rows whose upstream
/// gradients are all zero. Logits are recomputed, never stored.
///
/// # Panics
/// When a slice of `problem`, `stats` or `grad` is shorter than `n`, `d`, `v` say.
pub fn linear_logp_backward(
    problem: &LogpProblem<'_>,
    stats: &[f32],
    grad: &[f32],
    want_hidden: bool,
    want_weight: bool,
    want_bias: bool,
) -> HostGrads {
    let (n, d, v) = (problem.n, problem.d, problem.v);
    let hidden_grad = want_hidden.then(|| {
        let mut dh = vec![0.0f32; n * d];
        if d > 0 {
            dh.par_chunks_mut(d).enumerate().for_each(|(i, row)| {
                let (lse, entropy, g) = problem.row(i, stats, grad);
                if g.is_zero() {
                    return;
                }
                let target = problem.target(i);
                for j in 0..v {
                    let z = problem.logit(i, j);
                    let dz = problem.dlogit(z, lse, entropy, g, target == Some(j));
                    let w = &problem.weight[j * d..(j + 1) * d];
                    for (acc, wv) in row.iter_mut().zip(w) {
                        *acc = dz.mul_add(*wv, *acc);
                    }
                }
            });
        }
        dh
    });
    let (weight_grad, bias_grad) = if want_weight || want_bias {
        // One pass per vocabulary row: dWeight[j] and dBias[j] over tokens in ascending order.
        let per_row: Vec<(Vec<f32>, f32)> = (0..v)
            .into_par_iter()
            .map(|j| {
                let mut dw = vec![0.0f32; if want_weight { d } else { 0 }];
                let mut db = 0.0f32;
                for i in 0..n {
                    let (lse, entropy, g) = problem.row(i, stats, grad);
                    if g.is_zero() {
                        continue;
                    }
                    let z = problem.logit(i, j);
                    let dz = problem.dlogit(z, lse, entropy, g, problem.target(i) == Some(j));
                    let h = &problem.hidden[i * d..(i + 1) * d];
                    for (acc, hv) in dw.iter_mut().zip(h) {
                        *acc = dz.mul_add(*hv, *acc);
                    }
                    db += dz;
                }
                (dw, db)
            })
            .collect();
        let weight_grad = want_weight.then(|| {
            per_row
                .iter()
                .flat_map(|(dw, _)| dw.iter().copied())
                .collect()
        });
        let bias_grad = want_bias.then(|| per_row.iter().map(|(_, db)| *db).collect());
        (weight_grad, bias_grad)
    } else {
        (None, None)
    };
    (hidden_grad, weight_grad, bias_grad)
}
