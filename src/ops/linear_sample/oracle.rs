//! The Reference arithmetic of `linear_sample` on host slices: the token of each row from its
//! logits (those of `linear_logp`), then the row's statistics by the `linear_logp` oracle with
//! the token as the target, so they are its bits.
use rayon::prelude::*;

use super::noise;
use super::{SampleRule, Sampler};
use crate::ops::linear_logp::oracle::{self as logp, LogpProblem};

/// A candidate: its ranking key, logit and vocabulary index.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    key: f32,
    index: usize,
}

impl Candidate {
    /// Whether `self` ranks before `other`: a larger key, on equal keys the smaller index. Keys
    /// that are −∞ or NaN never rank.
    fn beats(&self, other: Option<&Candidate>) -> bool {
        self.key > f32::NEG_INFINITY
            && other.is_none_or(|o| self.key > o.key || (self.key == o.key && self.index < o.index))
    }
}

/// The token of row `i`, or `None` when every tempered logit is −∞ or NaN.
fn token(problem: &LogpProblem<'_>, sampler: &Sampler, key: i64, i: usize) -> Option<usize> {
    let logits = (0..problem.v).map(|j| (problem.logit(i, j), j));
    choose(logits, sampler.rule, noise::row_word(sampler.seed, key))
}

/// The column `rule` picks among `(tempered logit, column)` pairs, offered in any order, with the
/// row's noise word `row`; `None` when no logit ranks (all −∞ or NaN). Tensor parallelism picks
/// with it among the shards' merged top-k lists.
pub(crate) fn choose(
    logits: impl Iterator<Item = (f32, usize)>,
    rule: SampleRule,
    row: u32,
) -> Option<usize> {
    let logits = logits.map(|(key, index)| Candidate { key, index });
    let gumbel = |c: Candidate| Candidate {
        key: c.key + noise::gumbel(row, c.index as u32),
        ..c
    };
    let chosen = match rule {
        SampleRule::Greedy => kept(logits, 1).pop(),
        SampleRule::Gumbel => kept(logits.map(gumbel), 1).pop(),
        SampleRule::TopK(k) => kept(kept(logits, k).into_iter().map(gumbel), 1).pop(),
    };
    chosen.map(|c| c.index)
}

/// The `k` best of `cands` that rank at all, best first.
fn kept(cands: impl Iterator<Item = Candidate>, k: usize) -> Vec<Candidate> {
    let mut top: Vec<Candidate> = Vec::with_capacity(k + 1);
    for c in cands {
        if !c.beats(top.get(k.saturating_sub(1)).filter(|_| top.len() == k)) {
            continue;
        }
        let at = top
            .iter()
            .position(|t| c.beats(Some(t)))
            .unwrap_or(top.len());
        top.insert(at, c);
        top.truncate(k);
    }
    top
}

/// `[N, 2k]` f32: each row's `k` largest tempered logits, best first (ties to the smaller
/// column), then their columns; slots past the row's ranking logits are `(−∞, −1)`.
/// `problem.targets` and `problem.entropy` are not read.
///
/// # Panics
/// When a slice of `problem` is shorter than `n`, `d`, `v` say.
pub fn linear_top_k(problem: &LogpProblem<'_>, k: usize) -> Vec<f32> {
    (0..problem.n)
        .into_par_iter()
        .flat_map_iter(|i| {
            let logits = (0..problem.v).map(|j| Candidate {
                key: problem.logit(i, j),
                index: j,
            });
            let top = kept(logits, k);
            let z = (0..k).map(|e| top.get(e).map_or(f32::NEG_INFINITY, |c| c.key));
            let j = (0..k).map(|e| top.get(e).map_or(-1.0, |c| c.index as f32));
            z.chain(j).collect::<Vec<f32>>()
        })
        .collect()
}

/// `[N, C + 1]` f32: `(logp, lse[, entropy])` as `linear_logp` gives them for the sampled token,
/// then the token (−1 for a row with no finite logit, whose `logp` is NaN). `problem.targets`
/// holds the row keys; its `ignore_index` is not used.
///
/// # Panics
/// When a slice of `problem` is shorter than `n`, `d`, `v` say.
pub fn linear_sample(problem: &LogpProblem<'_>, sampler: &Sampler) -> Vec<f32> {
    let tokens: Vec<i64> = (0..problem.n)
        .into_par_iter()
        .map(|i| token(problem, sampler, problem.targets[i], i).map_or(-1, |t| t as i64))
        .collect();
    let scored = LogpProblem {
        targets: &tokens,
        ignore_index: None,
        ..*problem
    };
    let stats = logp::linear_logp(&scored);
    let c = scored.columns();
    stats
        .chunks(c)
        .zip(&tokens)
        .flat_map(|(row, &t)| row.iter().copied().chain([t as f32]))
        .collect()
}
