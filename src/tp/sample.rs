//! Tensor-parallel [`crate::linear_sample`]: a two-level Gumbel-max draw over the vocabulary's
//! leaves (the segments of [`super::segment_bounds`], or the pieces of a segment that shard
//! boundaries cut), then the drawn tokens scored by [`super::linear_logp_full`].
//!
//! Each rank draws one candidate per row in each of its leaves with the single-rank sampler on
//! that slice of its weight (noise from `(seed, key, column within the leaf)`), and the leaf's
//! tempered `lse`. One host all-gather exchanges every leaf's `(lse, candidate)`; every rank then
//! picks, per row, the leaf with the largest `lse_leaf + G(seed, key, V_global + leaf start)`
//! (ties to the smaller start) and takes its candidate. This is an exact draw from the global
//! tempered softmax: the leaf is drawn with probability `exp(lse_leaf − lse)` (Gumbel-max over
//! the leaves' masses), the token within it by its own Gumbel-max, whose noise is independent of
//! the leaf's (other hash inputs). With shards on segment boundaries the leaves are the 8
//! segments for every world size, so the tokens, and the `logp`, `lse` and `entropy` that
//! [`super::linear_logp_full`] gives them, are bitwise the same for worlds 1, 2, 4 and 8.
//!
//! Greedy and top-k need no leaves: each rank's top-`k` list (logits and columns) over its whole
//! shard, one host all-gather, then the Reference's pick among the merged lists. A column's logit
//! depends on its own weight row alone, so the merged list is the whole vocabulary's for any
//! sharding, and the token that of the single-rank Reference for the same logits.
use burn::tensor::{DType, Int, Tensor, TensorData};

use super::check::{self, fnv1a};
use super::{Collective, VocabShard};
use crate::ops::linear_sample::noise::{gumbel, row_word};
use crate::ops::linear_sample::{SampleRule, api::linear_top_k, oracle::choose};
use crate::validate::host_data;
use crate::{
    InvariantBackend, InvariantError, LinearLogpOptions, LinearSampleOutput, SampleOptions,
};

/// Tensor-parallel [`crate::linear_sample`]: one token per row of `hidden [N, D]` drawn from the
/// tempered softmax over the global vocabulary, and its `logp`, `lse` (and `entropy` with
/// `options.entropy`) bitwise those of [`super::linear_logp_full`] for the drawn tokens with
/// [`SampleOptions::logp_options`]; the same on every rank. `weight [end − start, D]` and
/// `bias` are this rank's shard; `hidden` and `keys [N]` are global (the same on every rank,
/// checked by a hash with the seed, the temperature and the rule). `greedy` and `top_k` merge the
/// ranks' own top-k lists (logits and columns, [`LinearSampleOps::invariant_linear_top_k`]) in
/// rank order and pick on the host as the Reference does: a column's logit depends on its weight
/// row alone, so the merged list, and the token, are the same for every sharding of the
/// vocabulary, even or not. The outputs are not differentiable. Validation is collective (the same
/// error on every rank), as for [`super::linear_logp`].
///
/// [`LinearSampleOps::invariant_linear_top_k`]: crate::ops::linear_sample::LinearSampleOps::invariant_linear_top_k
pub fn linear_sample<B, G>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    keys: Tensor<B, 1, Int>,
    bias: Option<Tensor<B, 1>>,
    shard: &VocabShard,
    group: &G,
    options: &SampleOptions,
) -> Result<LinearSampleOutput<B>, InvariantError>
where
    B: InvariantBackend,
    G: Collective<B> + Clone + 'static,
{
    let (hidden, weight) = (hidden.detach(), weight.detach());
    let bias = bias.map(|b| b.detach());
    let n = hidden.dims()[0];
    let device = hidden.device();
    let logp_options = options.logp_options();
    let local = local_keys(&keys, n, options);
    let extra = local.as_ref().map(|(_, hash)| *hash).map_err(Clone::clone);
    let zeros = Tensor::<B, 1, Int>::zeros([n], &device);
    let (plan, _) = check::collective(
        &check::RankInputs {
            hidden: &hidden,
            weight: &weight,
            targets: &zeros,
            bias: bias.as_ref(),
            shard,
            options: &LinearLogpOptions {
                skip_target_check: true,
                ..logp_options.clone()
            },
            entropy: options.entropy,
            extra: Some(&extra),
        },
        group,
    )?;
    let (keys_host, _) = local?;
    if n == 0 {
        return empty(&device, options.entropy);
    }
    let rule = options.sampler()?.rule;
    let ranked = match rule {
        SampleRule::Gumbel => None,
        SampleRule::Greedy => Some(1),
        SampleRule::TopK(k) => Some(k),
    };
    if let Some(k) = ranked {
        let inputs = (&hidden, &weight, &keys, bias.as_ref());
        let block = ranked_block(inputs, k, shard, options)?;
        let values = group.all_gather_host(&block)?;
        let tokens = pick_ranked(&values, k, n, &keys_host, rule, options.seed);
        let tokens = Tensor::<B, 1, Int>::from_data(TensorData::new(tokens, [n]), &device);
        return scored(hidden, weight, tokens, bias, shard, group, options);
    }
    let leaves: Vec<Vec<(usize, usize)>> = plan
        .shards
        .iter()
        .map(|&(start, end)| leaves_of(&plan.bounds, start, end))
        .collect();
    let slots = leaves.iter().map(Vec::len).max().unwrap_or(0);
    let draw = SampleOptions {
        entropy: false,
        ..options.clone()
    };
    let inputs = (&hidden, &weight, &keys, bias.as_ref());
    let block = leaf_block(inputs, &leaves[plan.rank], slots, shard, &draw)?;
    let values = group.all_gather_host(&block)?;
    let tokens = pick(&values, &leaves, slots, n, &keys_host, options.seed, shard);
    let tokens = Tensor::<B, 1, Int>::from_data(TensorData::new(tokens, [n]), &device);
    scored(hidden, weight, tokens, bias, shard, group, options)
}

/// The drawn `tokens` with the `logp`, `lse` and `entropy` [`super::linear_logp_full`] gives them.
fn scored<B, G>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    tokens: Tensor<B, 1, Int>,
    bias: Option<Tensor<B, 1>>,
    shard: &VocabShard,
    group: &G,
    options: &SampleOptions,
) -> Result<LinearSampleOutput<B>, InvariantError>
where
    B: InvariantBackend,
    G: Collective<B> + Clone + 'static,
{
    let scored = super::linear_logp_full(
        hidden,
        weight,
        tokens.clone(),
        bias,
        shard,
        group,
        &options.logp_options(),
    )?;
    Ok(LinearSampleOutput {
        tokens,
        logp: scored.logp,
        lse: scored.lse,
        entropy: scored.entropy,
    })
}

/// This rank's host block for `greedy` / `top_k`: its shard's top-`k` lists, the logits' bits
/// `[N, k]` then the global columns `[N, k]` (`u64::MAX` for an empty slot).
fn ranked_block<B: InvariantBackend>(
    (hidden, weight, keys, bias): LeafInputs<'_, B>,
    k: usize,
    shard: &VocabShard,
    options: &SampleOptions,
) -> Result<Vec<u64>, InvariantError> {
    let lists = linear_top_k(hidden, weight, keys, bias, k, options)?;
    let lists: Vec<f32> = host_data(lists, LEAF_DRAW)?.iter::<f32>().collect();
    let rows = || lists.chunks_exact(2 * k);
    let z = rows().flat_map(|r| r[..k].iter().map(|z| z.to_bits() as u64));
    let columns = rows().flat_map(|r| {
        r[k..].iter().map(|&j| {
            if j < 0.0 {
                u64::MAX
            } else {
                j as u64 + shard.start as u64
            }
        })
    });
    Ok(z.chain(columns).collect())
}

/// Per row, the token `rule` picks among every rank's list (rank order), with the row's noise.
fn pick_ranked(
    values: &[u64],
    k: usize,
    n: usize,
    keys: &[i64],
    rule: SampleRule,
    seed: u64,
) -> Vec<i64> {
    let per_rank = 2 * n * k;
    let ranks = values.len() / per_rank;
    (0..n)
        .map(|i| {
            let cands = (0..ranks).flat_map(|r| {
                let at = r * per_rank + i * k;
                (0..k).filter_map(move |e| {
                    let j = values[at + n * k + e];
                    (j != u64::MAX).then(|| (f32::from_bits(values[at + e] as u32), j as usize))
                })
            });
            choose(cands, rule, row_word(seed, keys[i])).map_or(-1, |j| j as i64)
        })
        .collect()
}

/// The argument a failed host read of the leaves' draws names.
const LEAF_DRAW: &str = "a leaf's draw";

/// This rank's host block: per leaf slot the bits of its lse `[N]` then its candidates `[N]`
/// (global indices); slots past its leaves carry lse −∞.
fn leaf_block<B: InvariantBackend>(
    (hidden, weight, keys, bias): LeafInputs<'_, B>,
    own: &[(usize, usize)],
    slots: usize,
    shard: &VocabShard,
    draw: &SampleOptions,
) -> Result<Vec<u64>, InvariantError> {
    let [n, d] = hidden.dims();
    let (mut lses, mut candidates) = (Vec::new(), Vec::new());
    for &(start, end) in own {
        let local_rows = start - shard.start..end - shard.start;
        let out = crate::linear_sample(
            hidden.clone(),
            weight.clone().slice([local_rows.clone(), 0..d]),
            keys.clone(),
            bias.cloned().map(|b| b.slice([local_rows])),
            draw,
        )?;
        lses.push(out.lse);
        candidates.push(out.tokens);
    }
    // One host read of each for all the leaves (every shard holds one at least: validated).
    let lses: Vec<f32> = host_data(Tensor::cat(lses, 0), LEAF_DRAW)?
        .iter::<f32>()
        .collect();
    let candidates: Vec<i64> = host_data(Tensor::cat(candidates, 0), LEAF_DRAW)?
        .iter::<i64>()
        .collect();
    let mut block = Vec::with_capacity(2 * slots * n);
    for (leaf, &(start, _)) in own.iter().enumerate() {
        let rows = leaf * n..(leaf + 1) * n;
        block.extend(lses[rows.clone()].iter().map(|x| x.to_bits() as u64));
        block.extend(candidates[rows].iter().map(|&t| (t + start as i64) as u64));
    }
    for _ in own.len()..slots {
        block.extend(std::iter::repeat_n(f32::NEG_INFINITY.to_bits() as u64, n));
        block.extend(std::iter::repeat_n(u64::MAX, n));
    }
    Ok(block)
}

/// `hidden`, this rank's weight shard, `keys` and its bias shard.
type LeafInputs<'a, B> = (
    &'a Tensor<B, 2>,
    &'a Tensor<B, 2>,
    &'a Tensor<B, 1, Int>,
    Option<&'a Tensor<B, 1>>,
);

/// This rank's own checks of what the table does not cover: the rule, and `keys` (`[N]`),
/// read once to the host; returns the keys and a hash of them with the seed and the rule.
fn local_keys<B: InvariantBackend>(
    keys: &Tensor<B, 1, Int>,
    n: usize,
    options: &SampleOptions,
) -> Result<(Vec<i64>, u64), InvariantError> {
    // The single-rank checks of the options (top_p, min_p, top_k, temperature).
    let rule = match options.sampler()?.rule {
        SampleRule::Gumbel => 0,
        SampleRule::Greedy => -1,
        SampleRule::TopK(k) => k as i64,
    };
    options.logp_options().head(options.entropy)?;
    if keys.dims() != [n] {
        return Err(InvariantError::Shape {
            arg: "keys",
            expected: format!("[{n}] (one key per row of hidden)"),
            got: keys.dims().to_vec(),
        });
    }
    let data = host_data(keys.clone(), "keys")?;
    let values: Vec<i64> = data.iter::<i64>().collect();
    let header = [
        options.seed as i64,
        options.temperature.to_bits() as i64,
        rule,
    ];
    let hash = fnv1a(header.into_iter().chain(values.iter().copied()));
    Ok((values, hash))
}

/// The leaves of the shard `[start, end)`: its parts of the segments, ascending.
fn leaves_of(bounds: &[usize], start: usize, end: usize) -> Vec<(usize, usize)> {
    bounds
        .windows(2)
        .map(|w| (w[0].max(start), w[1].min(end)))
        .filter(|(a, b)| a < b)
        .collect()
}

/// Per row, the candidate of the leaf with the largest `lse + G(seed, key, V + start)` (ties to
/// the smaller start; leaves come in rank order, each rank's ascending, so ascending starts).
fn pick(
    values: &[u64],
    leaves: &[Vec<(usize, usize)>],
    slots: usize,
    n: usize,
    keys: &[i64],
    seed: u64,
    shard: &VocabShard,
) -> Vec<i64> {
    let global = shard.global_vocab as u32;
    (0..n)
        .map(|i| {
            let row = row_word(seed, keys[i]);
            let mut best = (f32::NEG_INFINITY, -1i64);
            for (rank, own) in leaves.iter().enumerate() {
                for (slot, &(start, _)) in own.iter().enumerate() {
                    let at = (rank * slots + slot) * 2 * n;
                    let lse = f32::from_bits(values[at + i] as u32);
                    let key = lse + gumbel(row, global + start as u32);
                    if key > best.0 || best.1 < 0 {
                        best = (key, values[at + n + i] as i64);
                    }
                }
            }
            best.1
        })
        .collect()
}

fn empty<B: InvariantBackend>(
    device: &B::Device,
    entropy: bool,
) -> Result<LinearSampleOutput<B>, InvariantError> {
    let empty = || Tensor::<B, 1>::empty([0], (device, DType::F32));
    Ok(LinearSampleOutput {
        tokens: Tensor::empty([0], device),
        logp: empty(),
        lse: empty(),
        entropy: entropy.then(empty),
    })
}
