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
    let row = noise::row_word(sampler.seed, key);
    let gumbel = |c: Candidate| Candidate {
        key: c.key + noise::gumbel(row, c.index as u32),
        ..c
    };
    let logits = (0..problem.v).map(|j| Candidate {
        key: problem.logit(i, j),
        index: j,
    });
    let best = |cands: &mut dyn Iterator<Item = Candidate>| {
        cands.fold(None, |best: Option<Candidate>, c| {
            if c.beats(best.as_ref()) {
                Some(c)
            } else {
                best
            }
        })
    };
    let chosen = match sampler.rule {
        SampleRule::Greedy => best(&mut logits.into_iter()),
        SampleRule::Gumbel => best(&mut logits.map(gumbel)),
        SampleRule::TopK(k) => {
            let mut top: Vec<Candidate> = Vec::with_capacity(k + 1);
            for c in logits {
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
            best(&mut top.into_iter().map(gumbel))
        }
    };
    chosen.map(|c| c.index)
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
