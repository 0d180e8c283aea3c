//! Tensor-parallel `linear_sample` on NdArray with the in-process group: the same tokens and
//! statistics on every rank and for world sizes 1, 2, 4 and 8 (bitwise), the statistics those of
//! `tp::linear_logp_full` for the drawn tokens, the distribution (chi-square), greedy and top-k
//! those of the single-rank Reference for every sharding, collective errors.
#[allow(unused_macros)] // the generic suite macro is not used here
mod common;

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::{DType, Int, Tensor};
use burn_invariant::tp::{self, InProcessGroup, VocabShard};
use burn_invariant::{InvariantError, SampleOptions};
use common::ranks::{self, bits_of};
use common::sampler::one_row_head;
use common::{Rng, assert_bits_eq, float, ints, matrix_rows};

type B = burn::backend::NdArray<f32>;

const WATCHDOG: Duration = Duration::from_secs(120);

/// Host data every rank builds its tensors from.
#[derive(Clone)]
struct Draw {
    n: usize,
    d: usize,
    v: usize,
    hidden: Vec<f32>,
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    keys: Vec<i64>,
    options: SampleOptions,
}

fn draw_problem([n, d, v]: [usize; 3], with_bias: bool, seed: u64) -> Draw {
    let mut rng = Rng::new(seed);
    Draw {
        n,
        d,
        v,
        hidden: rng.vec(n * d, 1.0),
        weight: rng.vec(v * d, 3.0 / (d as f32).sqrt()),
        bias: with_bias.then(|| rng.vec(v, 1.0)),
        keys: (0..n as i64).map(|i| 1000 + 7 * i).collect(),
        options: SampleOptions::default().with_seed(seed),
    }
}

/// One rank's draw and the `tp::linear_logp_full` of its tokens, as host values.
#[derive(Debug, Clone)]
struct Out {
    tokens: Vec<i64>,
    logp: Vec<f32>,
    lse: Vec<f32>,
    entropy: Option<Vec<f32>>,
    scored_logp: Vec<f32>,
    scored_lse: Vec<f32>,
}

fn host(t: Tensor<B, 1>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

fn rank_draw(p: &Draw, shard: VocabShard, group: &InProcessGroup) -> Result<Out, InvariantError> {
    let device = Default::default();
    let hidden = || float::<B, 2>(p.hidden.clone(), [p.n, p.d], &device, DType::F32);
    let weight = || matrix_rows::<B>(&p.weight, p.d, shard.range(), &device, DType::F32);
    let bias = || {
        p.bias.as_ref().map(|b| {
            float::<B, 1>(
                b[shard.range()].to_vec(),
                [shard.len()],
                &device,
                DType::F32,
            )
        })
    };
    let keys = ints::<B>(p.keys.clone(), &device);
    let out = tp::linear_sample(hidden(), weight(), keys, bias(), &shard, group, &p.options)?;
    let tokens: Vec<i64> = out.tokens.clone().into_data().iter::<i64>().collect();
    let scored = tp::linear_logp_full(
        hidden(),
        weight(),
        out.tokens,
        bias(),
        &shard,
        group,
        &p.options.logp_options(),
    )?;
    Ok(Out {
        tokens,
        logp: host(out.logp),
        lse: host(out.lse),
        entropy: out.entropy.map(host),
        scored_logp: host(scored.logp),
        scored_lse: host(scored.lse),
    })
}

/// Every rank's draw, rank `r` with `rank_problem(r, p)`.
fn run(
    p: &Draw,
    shards: &[VocabShard],
    rank_problem: impl Fn(usize, &Draw) -> Draw + Send + Sync + 'static,
) -> Vec<Result<Out, InvariantError>> {
    let p = Arc::new(p.clone());
    let shards = shards.to_vec();
    ranks::on_ranks(
        InProcessGroup::new(shards.len()),
        WATCHDOG,
        move |rank, group| rank_draw(&rank_problem(rank, &p), shards[rank], &group),
    )
}

fn run_ok(p: &Draw, shards: &[VocabShard]) -> Vec<Out> {
    run(p, shards, |_, p| p.clone())
        .into_iter()
        .map(|r| r.expect("tp::linear_sample"))
        .collect()
}

fn split(world: usize, v: usize) -> Vec<VocabShard> {
    (0..world).map(|r| VocabShard::split(r, world, v)).collect()
}

fn assert_same(what: &str, got: &Out, want: &Out) {
    assert_eq!(got.tokens, want.tokens, "{what}: tokens");
    assert_bits_eq(
        &format!("{what}: logp"),
        &bits_of(&got.logp),
        &bits_of(&want.logp),
    );
    assert_bits_eq(
        &format!("{what}: lse"),
        &bits_of(&got.lse),
        &bits_of(&want.lse),
    );
    assert_bits_eq(
        &format!("{what}: entropy"),
        &bits_of(got.entropy.as_deref().unwrap_or_default()),
        &bits_of(want.entropy.as_deref().unwrap_or_default()),
    );
}

#[test]
fn tokens_and_statistics_are_bitwise_the_same_for_every_world_size() {
    for (shape, with_bias, seed, t, entropy) in [
        ([13, 24, 600], true, 1, 1.0, false),
        ([9, 16, 2100], false, 2, 0.7, true),
        ([7, 33, 2048], true, 3, 1.6, true),
    ] {
        let mut p = draw_problem(shape, with_bias, seed);
        p.options = p.options.with_temperature(t).with_entropy(entropy);
        let one = run_ok(&p, &split(1, p.v));
        let what = format!("{shape:?} T={t}");
        // The statistics are tp::linear_logp_full's for the drawn tokens.
        assert_bits_eq(
            &format!("{what}: logp = scored"),
            &bits_of(&one[0].logp),
            &bits_of(&one[0].scored_logp),
        );
        assert_bits_eq(
            &format!("{what}: lse = scored"),
            &bits_of(&one[0].lse),
            &bits_of(&one[0].scored_lse),
        );
        assert!(one[0].tokens.iter().all(|&t| (0..p.v as i64).contains(&t)));
        for world in [2, 4, 8] {
            for (rank, out) in run_ok(&p, &split(world, p.v)).iter().enumerate() {
                assert_same(&format!("{what} world {world} rank {rank}"), out, &one[0]);
            }
        }
        // Another seed draws other tokens; a rerun the same ones.
        assert_same(
            &format!("{what} rerun"),
            &run_ok(&p, &split(2, p.v))[0],
            &one[0],
        );
        p.options.seed += 1;
        assert_ne!(
            run_ok(&p, &split(2, p.v))[0].tokens,
            one[0].tokens,
            "{what}: seed"
        );
    }
}

#[test]
fn uneven_shards_agree_on_every_rank_and_rerun() {
    let p = draw_problem([11, 16, 600], true, 4);
    let shards = [
        VocabShard::new(0, 130, p.v),
        VocabShard::new(130, 401, p.v),
        VocabShard::new(401, 600, p.v),
    ];
    let a = run_ok(&p, &shards);
    let b = run_ok(&p, &shards);
    for rank in 0..3 {
        assert_same(&format!("rank {rank} vs 0"), &a[rank], &a[0]);
        assert_same(&format!("rerun rank {rank}"), &b[rank], &a[rank]);
    }
    assert_bits_eq(
        "logp = scored",
        &bits_of(&a[0].logp),
        &bits_of(&a[0].scored_logp),
    );
}

/// One row drawn over many keys against the exact tempered softmax, on 2 ranks (V = 16: the 8
/// segments are 2 columns each, so every draw crosses leaves).
#[test]
fn the_draw_follows_the_tempered_softmax() {
    let (d, v, draws) = (3usize, 16usize, 20_000usize);
    let (h, w, z) = one_row_head(v);
    for t in [1.0, 0.5] {
        let p = Draw {
            n: draws,
            d,
            v,
            hidden: h.repeat(draws),
            weight: w.clone(),
            bias: None,
            keys: (0..draws as i64).collect(),
            options: SampleOptions::default().with_seed(2027).with_temperature(t),
        };
        let out = run_ok(&p, &split(2, v));
        let mut counts = vec![0usize; v];
        for &token in &out[0].tokens {
            counts[token as usize] += 1;
        }
        let weights: Vec<f64> = z.iter().map(|zj| (zj / t).exp()).collect();
        let total: f64 = weights.iter().sum();
        let chi2: f64 = (0..v)
            .map(|j| {
                let expected = draws as f64 * weights[j] / total;
                (counts[j] as f64 - expected).powi(2) / expected
            })
            .sum();
        // 15 degrees of freedom: p < 1e-6 beyond about 61.
        assert!(chi2 < 61.0, "T={t}: chi2 {chi2}, counts {counts:?}");
    }
}

fn errors(results: Vec<Result<Out, InvariantError>>) -> InvariantError {
    let errors: Vec<InvariantError> = results
        .into_iter()
        .map(|r| r.expect_err("every rank fails"))
        .collect();
    for e in &errors[1..] {
        assert_eq!(e, &errors[0], "the same error on every rank");
    }
    errors[0].clone()
}

/// Greedy and top-k pick among the ranks' merged top-k lists: the same tokens for every world
/// size and for uneven shards (one narrower than k, others cutting segments), and those of the
/// single-rank Reference `linear_sample`, whose logits and pick are the same.
#[test]
fn greedy_and_top_k_are_the_single_rank_draw_for_every_sharding() {
    for (shape, with_bias, seed, t) in [
        ([13, 24, 600], true, 8, 1.0),
        ([9, 16, 2100], false, 9, 0.7),
    ] {
        let base = draw_problem(shape, with_bias, seed);
        let v = base.v;
        let uneven = [
            VocabShard::new(0, 40, v),
            VocabShard::new(40, 401, v),
            VocabShard::new(401, v, v),
        ];
        for options in [
            base.options.clone().with_greedy(true),
            base.options.clone().with_top_k(1),
            base.options.clone().with_top_k(5),
            base.options.clone().with_top_k(64),
        ] {
            let mut p = base.clone();
            p.options = options.with_temperature(t).with_entropy(true);
            let what = format!(
                "{shape:?} T={t} greedy {} top_k {:?}",
                p.options.greedy, p.options.top_k
            );
            let device = Default::default();
            let single = burn_invariant::linear_sample(
                float::<B, 2>(p.hidden.clone(), [p.n, p.d], &device, DType::F32),
                float::<B, 2>(p.weight.clone(), [p.v, p.d], &device, DType::F32),
                ints::<B>(p.keys.clone(), &device),
                p.bias
                    .clone()
                    .map(|b| float::<B, 1>(b, [p.v], &device, DType::F32)),
                &p.options,
            )
            .expect("linear_sample");
            let single: Vec<i64> = single.tokens.into_data().iter::<i64>().collect();
            let one = run_ok(&p, &split(1, v));
            assert_eq!(one[0].tokens, single, "{what}: world 1 vs single rank");
            assert_bits_eq(
                &format!("{what}: logp = scored"),
                &bits_of(&one[0].logp),
                &bits_of(&one[0].scored_logp),
            );
            for shards in [split(2, v), split(4, v), split(8, v)] {
                for (rank, out) in run_ok(&p, &shards).iter().enumerate() {
                    let at = format!("{what} {} shards, rank {rank}", shards.len());
                    assert_same(&at, out, &one[0]);
                }
            }
            // Shards that cut segments: the same tokens (the statistics are those
            // tp::linear_logp_full gives this sharding).
            for (rank, out) in run_ok(&p, &uneven).iter().enumerate() {
                assert_eq!(out.tokens, single, "{what} uneven, rank {rank}");
                assert_bits_eq(
                    &format!("{what} uneven, rank {rank}: logp = scored"),
                    &bits_of(&out.logp),
                    &bits_of(&out.scored_logp),
                );
            }
        }
        // Top-k draws: another seed other tokens; greedy ignores the seed.
        let mut p = base.clone();
        p.options = p.options.with_top_k(64);
        let a = run_ok(&p, &split(2, v))[0].tokens.clone();
        p.options.seed += 1;
        assert_ne!(run_ok(&p, &split(2, v))[0].tokens, a, "top-k: seed");
    }
}

#[test]
fn bad_rules_and_keys_fail_every_rank_alike() {
    let p = draw_problem([5, 8, 64], false, 6);
    let shards = split(2, p.v);
    for (what, options) in [
        ("top_k", p.options.clone().with_top_k(0)),
        (
            "top_k",
            p.options.clone().with_top_k(burn_invariant::TOP_K_MAX + 1),
        ),
        (
            "top_p",
            SampleOptions {
                top_p: Some(0.9),
                ..p.options.clone()
            },
        ),
        ("temperature", p.options.clone().with_temperature(0.0)),
    ] {
        let mut q = p.clone();
        q.options = options;
        let e = errors(run(&q, &shards, |_, p| p.clone()));
        assert!(
            matches!(&e, InvariantError::RankFailed { reason, .. } if reason.contains(what)),
            "{what}: {e:?}"
        );
    }
    // Keys of the wrong length on one rank; keys, or the rule, that differ between ranks.
    let e = errors(run(&p, &shards, |r, p| Draw {
        keys: p.keys[..p.keys.len() - r].to_vec(),
        ..p.clone()
    }));
    assert!(
        matches!(e, InvariantError::RankFailed { rank: 1, .. }),
        "{e:?}"
    );
    let e = errors(run(&p, &shards, |r, p| Draw {
        keys: p.keys.iter().map(|k| k + r as i64).collect(),
        ..p.clone()
    }));
    assert!(
        matches!(e, InvariantError::RankMismatch { rank: 1, .. }),
        "{e:?}"
    );
    for other in [
        p.options.clone().with_greedy(true),
        p.options.clone().with_top_k(4),
    ] {
        let e = errors(run(&p, &shards, move |r, p| Draw {
            options: if r == 1 {
                other.clone()
            } else {
                p.options.clone()
            },
            ..p.clone()
        }));
        assert!(
            matches!(e, InvariantError::RankMismatch { rank: 1, .. }),
            "{e:?}"
        );
    }
}

#[test]
fn empty_batch_returns_empty_on_every_rank() {
    let mut p = draw_problem([0, 8, 64], false, 7);
    p.options = p.options.with_entropy(true);
    let keys: Vec<i64> = Vec::new();
    let results = ranks::on_ranks(InProcessGroup::new(2), WATCHDOG, move |rank, group| {
        let device = Default::default();
        let shard = VocabShard::split(rank, 2, p.v);
        let out = tp::linear_sample(
            Tensor::<B, 2>::empty([0, p.d], &device),
            matrix_rows::<B>(&p.weight, p.d, shard.range(), &device, DType::F32),
            Tensor::<B, 1, Int>::from_ints(keys.as_slice(), &device),
            None,
            &shard,
            &group,
            &p.options,
        )
        .expect("empty batch");
        (
            out.tokens.dims(),
            out.logp.dims(),
            out.entropy.map(|e| e.dims()),
        )
    });
    for r in results {
        assert_eq!(r, ([0], [0], Some([0])));
    }
}
