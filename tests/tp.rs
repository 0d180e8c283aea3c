//! Tensor-parallel `linear_logp` on NdArray with the in-process group: TP-size invariance
//! (bitwise), agreement with the single-rank API (tolerance), collective validation (the same
//! error on every rank, in bounded time).
#[allow(unused_macros)] // the generic suite macro is not used here
mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Tensor, backend::Backend};
use burn_invariant::tp::{self, InProcessGroup, VocabShard, segment_bounds};
use burn_invariant::{InvariantError, LinearLogpOptions};
use common::ranks::{self, bits_of};
use common::tp_problem::{
    IGNORE, Problem, RankOut, host, problem, rank_run, shard_logp, single_rank,
};
use common::{Rng, assert_bits_eq, float, ints, matrix_rows};

type B = burn::backend::NdArray<f32>;
type AD = burn::backend::Autodiff<B>;

/// Per-test watchdog: a rank that hangs fails the test instead of blocking CI.
const WATCHDOG: Duration = Duration::from_secs(120);

fn on_ranks<T: Send + 'static>(
    groups: Vec<InProcessGroup>,
    f: impl Fn(usize, InProcessGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    ranks::on_ranks(groups, WATCHDOG, f)
}

fn run_tp(p: &Problem, shards: &[VocabShard]) -> Vec<RankOut> {
    let p = Arc::new(p.clone());
    let shards = shards.to_vec();
    on_ranks(InProcessGroup::new(shards.len()), move |rank, group| {
        rank_run::<AD, _>(&p, &Default::default(), shards[rank], &group)
    })
}

fn split(world: usize, v: usize) -> Vec<VocabShard> {
    (0..world).map(|r| VocabShard::split(r, world, v)).collect()
}

fn cuts(v: usize, cuts: &[usize]) -> Vec<VocabShard> {
    let mut edges = vec![0];
    edges.extend_from_slice(cuts);
    edges.push(v);
    edges
        .windows(2)
        .map(|w| VocabShard::new(w[0], w[1], v))
        .collect()
}

/// Every rank returned the same logp, lse, entropy and dHidden, bit for bit.
fn assert_ranks_agree(what: &str, outs: &[RankOut]) {
    for (rank, out) in outs.iter().enumerate().skip(1) {
        assert_bits_eq(
            &format!("{what}: entropy rank {rank} vs 0"),
            &bits_of(out.entropy.as_deref().unwrap_or_default()),
            &bits_of(outs[0].entropy.as_deref().unwrap_or_default()),
        );
        assert_bits_eq(
            &format!("{what}: logp rank {rank} vs 0"),
            &bits_of(&out.logp),
            &bits_of(&outs[0].logp),
        );
        assert_bits_eq(
            &format!("{what}: lse rank {rank} vs 0"),
            &bits_of(&out.lse),
            &bits_of(&outs[0].lse),
        );
        assert_bits_eq(
            &format!("{what}: dHidden rank {rank} vs 0"),
            &bits_of(&out.hidden),
            &bits_of(&outs[0].hidden),
        );
    }
}

fn concat_weight(outs: &[RankOut]) -> Vec<f32> {
    outs.iter().flat_map(|o| o.weight.iter().copied()).collect()
}

fn concat_bias(outs: &[RankOut]) -> Option<Vec<f32>> {
    outs[0].bias.as_ref()?;
    Some(
        outs.iter()
            .flat_map(|o| o.bias.clone().unwrap_or_default())
            .collect(),
    )
}

#[test]
fn segment_aligned_tp_is_bitwise_invariant_across_world_sizes() {
    // V = 600: segments of 75 rows; V = 2100: segments on 256-row tile boundaries. The last
    // two: the RL head (temperature, entropy).
    for (shape, with_bias, ignore_every, seed, head) in [
        ([13, 24, 600], true, Some(4), 1, None),
        ([9, 16, 2100], false, None, 2, None),
        ([7, 33, 2048], true, Some(3), 3, None),
        ([13, 24, 600], true, Some(4), 4, Some(0.7)),
        ([9, 16, 2100], true, Some(3), 5, Some(1.7)),
    ] {
        let mut p = problem(shape, DType::F32, with_bias, ignore_every, seed);
        if let Some(t) = head {
            p.options = p.options.with_temperature(t).with_entropy(true);
        }
        let bounds = segment_bounds(p.v);
        let reference = run_tp(&p, &split(1, p.v));
        for world in [2, 4, 8] {
            let shards = split(world, p.v);
            for (r, s) in shards.iter().enumerate() {
                assert_eq!(
                    s.start,
                    bounds[r * 8 / world],
                    "shard {r} of {world} is aligned"
                );
            }
            let outs = run_tp(&p, &shards);
            let what = format!("V={} world={world}", p.v);
            assert_ranks_agree(&what, &outs);
            assert_bits_eq(
                &format!("{what}: logp vs world 1"),
                &bits_of(&outs[0].logp),
                &bits_of(&reference[0].logp),
            );
            assert_bits_eq(
                &format!("{what}: lse vs world 1"),
                &bits_of(&outs[0].lse),
                &bits_of(&reference[0].lse),
            );
            assert_eq!(outs[0].entropy.is_some(), head.is_some(), "{what}: entropy");
            assert_bits_eq(
                &format!("{what}: entropy vs world 1"),
                &bits_of(outs[0].entropy.as_deref().unwrap_or_default()),
                &bits_of(reference[0].entropy.as_deref().unwrap_or_default()),
            );
            assert_bits_eq(
                &format!("{what}: dHidden vs world 1"),
                &bits_of(&outs[0].hidden),
                &bits_of(&reference[0].hidden),
            );
            // Each segment's dWeight/dBias is the same leaf computation whichever rank runs it.
            assert_bits_eq(
                &format!("{what}: dWeight vs world 1"),
                &bits_of(&concat_weight(&outs)),
                &bits_of(&reference[0].weight),
            );
            if let (Some(got), Some(expected)) = (concat_bias(&outs), &reference[0].bias) {
                assert_bits_eq(
                    &format!("{what}: dBias vs world 1"),
                    &bits_of(&got),
                    &bits_of(expected),
                );
            }
        }
    }
}

fn assert_close(what: &str, got: &[f32], expected: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        let ok = (g - e).abs() <= atol + rtol * e.abs() || (g.is_nan() && e.is_nan());
        assert!(ok, "{what}[{i}]: got {g}, expected {e}");
    }
}

fn assert_matches_single_rank(what: &str, outs: &[RankOut], single: &RankOut) {
    assert_ranks_agree(what, outs);
    let o = &outs[0];
    assert_close(&format!("{what}: logp"), &o.logp, &single.logp, 1e-5, 1e-5);
    assert_close(&format!("{what}: lse"), &o.lse, &single.lse, 1e-5, 1e-5);
    match (&o.entropy, &single.entropy) {
        (Some(got), Some(expected)) => {
            assert_close(&format!("{what}: entropy"), got, expected, 2e-5, 1e-4)
        }
        (None, None) => {}
        _ => panic!("{what}: entropy presence differs"),
    }
    assert_close(
        &format!("{what}: dHidden"),
        &o.hidden,
        &single.hidden,
        1e-5,
        1e-4,
    );
    assert_close(
        &format!("{what}: dWeight"),
        &concat_weight(outs),
        &single.weight,
        1e-5,
        1e-4,
    );
    match (concat_bias(outs), &single.bias) {
        (Some(got), Some(expected)) => {
            assert_close(&format!("{what}: dBias"), &got, expected, 1e-5, 1e-4)
        }
        (None, None) => {}
        _ => panic!("{what}: bias gradient presence differs"),
    }
}

#[test]
fn matches_the_single_rank_api_for_1_2_3_4_ranks_and_uneven_shards() {
    let p = problem([11, 20, 600], DType::F32, true, Some(5), 7);
    let single = single_rank::<AD>(&p, &Default::default());
    let layouts: Vec<(&str, Vec<VocabShard>)> = vec![
        ("world 1", split(1, p.v)),
        ("world 2 aligned", split(2, p.v)),
        ("world 2 mid-segment", cuts(p.v, &[260])),
        ("world 3 even", split(3, p.v)),
        ("world 3 uneven", cuts(p.v, &[1, 420])),
        ("world 4 aligned", split(4, p.v)),
        ("world 4 uneven", cuts(p.v, &[75, 76, 599])),
    ];
    for (what, shards) in layouts {
        let outs = run_tp(&p, &shards);
        assert_matches_single_rank(what, &outs, &single);
    }
    // The RL head: temperature and entropy, the same layouts.
    let mut p = problem([11, 20, 600], DType::F32, true, Some(5), 9);
    p.options = p.options.with_temperature(0.3).with_entropy(true);
    let single = single_rank::<AD>(&p, &Default::default());
    for (what, shards) in [
        ("head world 1", split(1, p.v)),
        ("head world 3 uneven", cuts(p.v, &[1, 420])),
        ("head world 4 aligned", split(4, p.v)),
    ] {
        let outs = run_tp(&p, &shards);
        assert_matches_single_rank(what, &outs, &single);
    }
    // Without bias or ignore index, on a tile-aligned vocabulary.
    let p = problem([6, 16, 2300], DType::F32, false, None, 8);
    let single = single_rank::<AD>(&p, &Default::default());
    for (what, shards) in [
        ("V=2300 world 2", split(2, p.v)),
        ("V=2300 world 3", split(3, p.v)),
        ("V=2300 world 4", split(4, p.v)),
    ] {
        assert_matches_single_rank(what, &run_tp(&p, &shards), &single);
    }
}

#[test]
fn uneven_shards_are_run_to_run_deterministic() {
    let p = problem([9, 12, 500], DType::F32, true, Some(3), 11);
    let shards = cuts(p.v, &[130, 131, 377]);
    let (a, b) = (run_tp(&p, &shards), run_tp(&p, &shards));
    for (x, y) in a.iter().zip(&b) {
        assert_bits_eq("logp", &bits_of(&x.logp), &bits_of(&y.logp));
        assert_bits_eq("lse", &bits_of(&x.lse), &bits_of(&y.lse));
        assert_bits_eq("dHidden", &bits_of(&x.hidden), &bits_of(&y.hidden));
        assert_bits_eq("dWeight", &bits_of(&x.weight), &bits_of(&y.weight));
    }
}

#[test]
fn plain_backend_forward_equals_autodiff_forward() {
    let p = Arc::new(problem([10, 16, 600], DType::F32, true, Some(4), 12));
    let shards = split(2, p.v);
    let ad = run_tp(&p, &shards);
    let q = p.clone();
    let plain = on_ranks(InProcessGroup::new(2), move |rank, group| {
        let device = Default::default();
        let s = shards[rank];
        let (logp, lse) = tp::linear_logp_with_lse(
            float::<B, 2>(q.hidden.clone(), [q.n, q.d], &device, DType::F32),
            float::<B, 2>(
                q.weight[s.start * q.d..s.end * q.d].to_vec(),
                [s.len(), q.d],
                &device,
                DType::F32,
            ),
            ints::<B>(q.targets.clone(), &device),
            q.bias
                .as_ref()
                .map(|b| float::<B, 1>(b[s.range()].to_vec(), [s.len()], &device, DType::F32)),
            &s,
            &group,
            &q.options,
        )
        .unwrap();
        (host(logp), host(lse))
    });
    for (rank, (logp, lse)) in plain.iter().enumerate() {
        assert_bits_eq(
            &format!("logp rank {rank}"),
            &bits_of(logp),
            &bits_of(&ad[rank].logp),
        );
        assert_bits_eq(
            &format!("lse rank {rank}"),
            &bits_of(lse),
            &bits_of(&ad[rank].lse),
        );
    }
}

#[test]
fn ignored_rows_have_zero_logp_and_unchecked_bad_targets_give_nan() {
    let mut p = problem([8, 8, 64], DType::F32, false, Some(4), 13);
    p.targets[2] = 64; // out of range: only reachable with skip_target_check
    p.options.skip_target_check = true;
    let p = Arc::new(p);
    let q = p.clone();
    let outs = on_ranks(InProcessGroup::new(2), move |rank, group| {
        let device = Default::default();
        let s = VocabShard::split(rank, 2, q.v);
        let logp = shard_logp::<B, _>(&q, &device, &s, &group).unwrap();
        host(logp)
    });
    for logp in &outs {
        for (i, &t) in p.targets.iter().enumerate() {
            match t {
                IGNORE => assert_eq!(logp[i], 0.0, "ignored row {i}"),
                64 => assert!(logp[i].is_nan(), "bad target row {i}: {}", logp[i]),
                _ => assert!(logp[i].is_finite() && logp[i] < 0.0, "row {i}: {}", logp[i]),
            }
        }
    }
}

#[test]
fn empty_batch_returns_empty_on_every_rank() {
    let p = Arc::new(problem([0, 8, 64], DType::F32, true, None, 14));
    let outs = on_ranks(InProcessGroup::new(2), move |rank, group| {
        let device = Default::default();
        let s = VocabShard::split(rank, 2, p.v);
        let weight =
            matrix_rows::<AD>(&p.weight, p.d, s.range(), &device, DType::F32).require_grad();
        let (logp, lse) = tp::linear_logp_with_lse(
            float::<AD, 2>(vec![], [0, p.d], &device, DType::F32).require_grad(),
            weight.clone(),
            ints::<AD>(vec![], &device),
            None,
            &s,
            &group,
            &p.options,
        )
        .unwrap();
        let dims = (logp.dims(), lse.dims());
        let grads = (logp.sum() + lse.sum()).backward();
        let dweight = weight.grad(&grads).map(host);
        (dims, dweight)
    });
    for (dims, dweight) in outs {
        assert_eq!(dims, ([0], [0]));
        if let Some(dweight) = dweight {
            assert!(dweight.iter().all(|&x| x == 0.0));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Collective validation: a fault on one rank, the same error on all.

/// Per-rank inputs of a validation case, as host data.
#[derive(Clone)]
struct RankCase {
    n: usize,
    d: usize,
    weight_rows: usize,
    shard: VocabShard,
    targets: Vec<i64>,
    with_bias: bool,
    options: LinearLogpOptions,
}

fn healthy(world: usize, v: usize) -> Vec<RankCase> {
    let mut rng = Rng::new(99);
    let targets: Vec<i64> = (0..6).map(|_| rng.below(v) as i64).collect();
    split(world, v)
        .into_iter()
        .map(|shard| RankCase {
            n: 6,
            d: 8,
            weight_rows: shard.len(),
            shard,
            targets: targets.clone(),
            with_bias: true,
            options: LinearLogpOptions::default(),
        })
        .collect()
}

/// Runs the cases (one per rank) and returns every rank's error; asserts they are equal.
fn errors_of(cases: Vec<RankCase>) -> InvariantError {
    let world = cases.len();
    let groups = InProcessGroup::with_timeout(world, Duration::from_secs(30));
    let start = Instant::now();
    let errors = on_ranks(groups, move |rank, group| {
        let c = &cases[rank];
        let device = Default::default();
        let mut rng = Rng::new(rank as u64 + 1);
        tp::linear_logp(
            float::<B, 2>(rng.vec(c.n * c.d, 1.0), [c.n, c.d], &device, DType::F32),
            float::<B, 2>(
                rng.vec(c.weight_rows * c.d, 0.3),
                [c.weight_rows, c.d],
                &device,
                DType::F32,
            ),
            ints::<B>(c.targets.clone(), &device),
            c.with_bias.then(|| {
                float::<B, 1>(
                    rng.vec(c.weight_rows, 1.0),
                    [c.weight_rows],
                    &device,
                    DType::F32,
                )
            }),
            &c.shard,
            &group,
            &c.options,
        )
        .map(|_| ())
        .expect_err("a faulty rank must fail every rank")
    });
    // Validation is one exchange: no rank waits for the group's timeout.
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    for (rank, e) in errors.iter().enumerate() {
        assert_eq!(e, &errors[0], "rank {rank}'s error differs from rank 0's");
    }
    errors.into_iter().next().unwrap()
}

#[test]
fn a_gap_or_overlap_in_the_partition_fails_every_rank() {
    let mut cases = healthy(3, 120);
    cases[1].shard.start += 1;
    cases[1].weight_rows -= 1;
    let e = errors_of(cases);
    assert!(
        matches!(e, InvariantError::Partition { rank: 1, .. }),
        "{e}"
    );

    let mut cases = healthy(3, 120);
    cases[2].shard.start -= 1;
    cases[2].weight_rows += 1;
    let e = errors_of(cases);
    assert!(
        matches!(e, InvariantError::Partition { rank: 2, .. }),
        "{e}"
    );

    let mut cases = healthy(2, 120);
    cases[1].shard.end -= 1;
    cases[1].weight_rows -= 1;
    let e = errors_of(cases);
    assert!(
        matches!(e, InvariantError::Partition { rank: 1, .. }),
        "{e}"
    );
}

#[test]
fn an_empty_or_mismatched_shard_fails_every_rank() {
    let mut cases = healthy(3, 120);
    cases[1].shard.end = cases[1].shard.start;
    let e = errors_of(cases);
    assert!(
        matches!(
            e,
            InvariantError::RankFailed {
                rank: 1,
                world: 3,
                ..
            }
        ),
        "{e}"
    );

    let mut cases = healthy(3, 120);
    cases[2].weight_rows += 2;
    let e = errors_of(cases);
    match &e {
        InvariantError::RankFailed {
            rank: 2, reason, ..
        } => {
            assert!(reason.contains("`weight`"), "{e}")
        }
        _ => panic!("{e}"),
    }
}

#[test]
fn inconsistent_sizes_fail_every_rank() {
    let mut cases = healthy(3, 120);
    cases[2].shard.global_vocab = 121;
    let e = errors_of(cases);
    assert!(
        matches!(e, InvariantError::RankMismatch { rank: 2, what, .. } if what.starts_with("V_global")),
        "{e}"
    );

    let mut cases = healthy(3, 120);
    cases[1].n = 5;
    cases[1].targets.pop();
    let e = errors_of(cases);
    assert!(
        matches!(e, InvariantError::RankMismatch { rank: 1, what, .. } if what.starts_with("N ")),
        "{e}"
    );

    let mut cases = healthy(3, 120);
    cases[1].d = 7;
    let e = errors_of(cases);
    assert!(
        matches!(e, InvariantError::RankMismatch { rank: 1, what, .. } if what.starts_with("D ")),
        "{e}"
    );

    let mut cases = healthy(3, 120);
    cases[0].with_bias = false;
    let e = errors_of(cases);
    assert!(
        matches!(e, InvariantError::RankMismatch { rank: 1, what, .. } if what.contains("bias")),
        "{e}"
    );

    let mut cases = healthy(3, 120);
    cases[2].options.ignore_index = Some(IGNORE);
    let e = errors_of(cases);
    assert!(
        matches!(e, InvariantError::RankMismatch { rank: 2, what, .. } if what.contains("ignore_index")),
        "{e}"
    );
}

#[test]
fn targets_must_agree_and_be_owned_by_some_rank() {
    // One rank's targets differ: caught by the hash even though each is in range.
    let mut cases = healthy(3, 120);
    cases[1].targets[3] = (cases[1].targets[3] + 1) % 120;
    let e = errors_of(cases);
    assert!(
        matches!(e, InvariantError::RankMismatch { rank: 1, what, .. } if what.contains("targets")),
        "{e}"
    );

    // A target outside [0, V_global) on every rank: owned by none.
    let mut cases = healthy(4, 120);
    for c in &mut cases {
        c.targets[4] = 120;
        c.targets[5] = -3;
    }
    let e = errors_of(cases);
    assert_eq!(
        e,
        InvariantError::TargetOutOfRange {
            index: 4,
            value: 120,
            vocab: 120,
            count: 2,
            ignore_index: None,
        }
    );

    // A target equal to ignore_index is owned by no rank and allowed; others still checked.
    let mut cases = healthy(2, 120);
    for c in &mut cases {
        c.options.ignore_index = Some(IGNORE);
        c.targets[0] = IGNORE;
        c.targets[1] = -1;
    }
    let e = errors_of(cases);
    assert!(
        matches!(
            e,
            InvariantError::TargetOutOfRange {
                index: 1,
                value: -1,
                count: 1,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn a_rank_that_never_arrives_fails_the_others_in_bounded_time() {
    let p = Arc::new(problem([4, 8, 64], DType::F32, false, None, 15));
    let mut groups = InProcessGroup::with_timeout(3, Duration::from_millis(300));
    let absent = groups.pop().unwrap();
    let start = Instant::now();
    let q = p.clone();
    let errors = on_ranks(groups, move |rank, group| {
        let device = Default::default();
        let s = VocabShard::split(rank, 3, q.v);
        shard_logp::<B, _>(&q, &device, &s, &group).unwrap_err()
    });
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(errors[0], errors[1]);
    assert!(
        matches!(&errors[0], InvariantError::Collective { reason } if reason.contains("[2]")),
        "{}",
        errors[0]
    );
    // The late rank gets the same error at once.
    let device = Default::default();
    let s = VocabShard::split(2, 3, p.v);
    let late = shard_logp::<B, _>(&p, &device, &s, &absent).unwrap_err();
    assert_eq!(late, errors[0]);
}

// ---------------------------------------------------------------------------------------------
// Faults during the exchanges: the call (or, in the backward, the next call) fails on every
// rank, never a panic or a hang.

/// What [`Faulty`] does to this rank's `at`-th tensor exchange (0: the forward's, 1: the
/// backward's) and after.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// Nothing: the wrapped group as it is.
    Healthy,
    /// Fails at once, without taking part.
    Refuse { at: usize },
    /// Takes part after `delay` (past the peers' timeout).
    Late { at: usize, delay: Duration },
    /// Takes part, but the block comes back NaN and the failure surfaces from `settle`, as
    /// with an exchange that was only enqueued (NCCL's device-side timeout).
    Deferred { at: usize },
}

/// An in-process group with a fault on this rank, and the device it reports.
#[derive(Debug, Clone)]
struct Faulty<D> {
    inner: InProcessGroup,
    fault: Fault,
    device: Option<D>,
    exchanges: Arc<AtomicUsize>,
    pending: Arc<Mutex<Option<InvariantError>>>,
}

impl<D> Faulty<D> {
    fn new(inner: InProcessGroup, fault: Fault, device: Option<D>) -> Self {
        Self {
            inner,
            fault,
            device,
            exchanges: Arc::default(),
            pending: Arc::default(),
        }
    }
}

fn injected(what: &str) -> InvariantError {
    InvariantError::Collective {
        reason: format!("injected: {what}"),
    }
}

impl<X: Backend> tp::Collective<X> for Faulty<X::Device> {
    fn rank(&self) -> usize {
        tp::Collective::<X>::rank(&self.inner)
    }

    fn world_size(&self) -> usize {
        tp::Collective::<X>::world_size(&self.inner)
    }

    fn all_gather_host(&self, block: &[u64]) -> Result<Vec<u64>, InvariantError> {
        tp::Collective::<X>::all_gather_host(&self.inner, block)
    }

    fn all_gather(&self, block: Tensor<X, 1>) -> Result<Tensor<X, 1>, InvariantError> {
        let index = self.exchanges.fetch_add(1, Ordering::SeqCst);
        match self.fault {
            Fault::Refuse { at } if index == at => Err(injected("refused exchange")),
            Fault::Late { at, delay } if index == at => {
                std::thread::sleep(delay);
                self.inner.all_gather(block)
            }
            Fault::Deferred { at } if index >= at => {
                let gathered = self.inner.all_gather(block)?;
                *self.pending.lock().unwrap() = Some(injected("deferred exchange failure"));
                Ok(gathered.full_like(f32::NAN))
            }
            _ => self.inner.all_gather(block),
        }
    }

    fn settle(&self) -> Result<(), InvariantError> {
        match self.pending.lock().unwrap().take() {
            Some(error) => {
                tp::Collective::<X>::fail(&self.inner, error.clone());
                Err(error)
            }
            None => tp::Collective::<X>::settle(&self.inner),
        }
    }

    fn fail(&self, error: InvariantError) {
        tp::Collective::<X>::fail(&self.inner, error)
    }

    fn device(&self) -> Option<X::Device> {
        self.device.clone()
    }
}

/// One rank's `tp::linear_logp_with_lse` forward (and backward) on Autodiff<NdArray>: the
/// call's result, then the gradients when the forward succeeded.
fn faulty_step<G: tp::Collective<AD> + Clone + 'static>(
    p: &Problem,
    shard: VocabShard,
    group: &G,
) -> Result<RankOut, InvariantError> {
    let device = Default::default();
    let hidden = float::<AD, 2>(p.hidden.clone(), [p.n, p.d], &device, DType::F32).require_grad();
    let rows = shard.range();
    let weight =
        matrix_rows::<AD>(&p.weight, p.d, rows.clone(), &device, DType::F32).require_grad();
    let bias = (p.bias.as_ref())
        .map(|b| float::<AD, 1>(b[rows].to_vec(), [shard.len()], &device, DType::F32))
        .map(Tensor::require_grad);
    let targets = ints::<AD>(p.targets.clone(), &device);
    let (logp, lse) = tp::linear_logp_with_lse(
        hidden.clone(),
        weight.clone(),
        targets,
        bias.clone(),
        &shard,
        group,
        &p.options,
    )?;
    let grads = (logp.clone() + lse.clone()).sum().backward();
    Ok(RankOut {
        logp: host(logp.inner()),
        lse: host(lse.inner()),
        entropy: None,
        hidden: host(hidden.grad(&grads).expect("hidden grad")),
        weight: host(weight.grad(&grads).expect("weight grad")),
        bias: bias.map(|b| host(b.grad(&grads).expect("bias grad"))),
    })
}

/// Runs [`faulty_step`] twice on every rank of a world of `faults.len()` (rank r with
/// `faults[r]`): both results per rank, and the time it all took.
fn two_steps(
    p: &Problem,
    faults: &[Fault],
    timeout: Duration,
) -> (Vec<[Result<RankOut, InvariantError>; 2]>, Duration) {
    let (p, world) = (Arc::new(p.clone()), faults.len());
    let groups = InProcessGroup::with_timeout(world, timeout)
        .into_iter()
        .zip(faults)
        .map(|(g, &fault)| Faulty::new(g, fault, None))
        .collect();
    let start = Instant::now();
    let out = ranks::on_ranks(groups, WATCHDOG, move |rank, group| {
        let shard = VocabShard::split(rank, world, p.v);
        [
            faulty_step(&p, shard, &group),
            faulty_step(&p, shard, &group),
        ]
    });
    (out, start.elapsed())
}

fn all_nan(values: &[f32]) -> bool {
    !values.is_empty() && values.iter().all(|v| v.is_nan())
}

#[test]
fn a_collective_failure_in_the_backward_gives_nan_gradients_then_an_error_on_every_rank() {
    let p = problem([5, 8, 96], DType::F32, true, None, 31);
    let refuse = Fault::Refuse { at: 1 };
    // The group's timeout is long: the failing rank wakes its waiting peers at once.
    let (out, took) = two_steps(
        &p,
        &[Fault::Healthy, refuse, Fault::Healthy],
        Duration::from_secs(60),
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
    let expected = injected("refused exchange");
    for (rank, [first, second]) in out.into_iter().enumerate() {
        let first = first.unwrap_or_else(|e| panic!("rank {rank}: the forward failed: {e}"));
        assert!(first.logp.iter().all(|v| v.is_finite()), "rank {rank}");
        assert!(
            all_nan(&first.hidden),
            "rank {rank}: dHidden {:?}",
            first.hidden
        );
        assert!(all_nan(&first.weight), "rank {rank}: dWeight");
        assert!(
            all_nan(first.bias.as_deref().unwrap()),
            "rank {rank}: dBias"
        );
        assert_eq!(first.hidden.len(), p.n * p.d);
        assert_eq!(
            first.bias.map(|b| b.len()),
            Some(VocabShard::split(rank, 3, p.v).len())
        );
        assert_eq!(second.unwrap_err(), expected, "rank {rank}'s next call");
    }
}

#[test]
fn a_deferred_exchange_failure_fails_its_own_call_on_every_rank() {
    let p = problem([4, 8, 64], DType::F32, false, None, 32);
    // The forward's exchange: the call itself fails (NaN never reaches the caller).
    let (out, _) = two_steps(&p, &[Fault::Deferred { at: 0 }; 2], Duration::from_secs(30));
    for (rank, [first, second]) in out.into_iter().enumerate() {
        let expected = injected("deferred exchange failure");
        assert_eq!(first.map(|_| ()).unwrap_err(), expected, "rank {rank}");
        assert_eq!(second.map(|_| ()).unwrap_err(), expected, "rank {rank}");
    }
    // The backward's: NaN gradients, and the next call fails.
    let (out, _) = two_steps(&p, &[Fault::Deferred { at: 1 }; 2], Duration::from_secs(30));
    for (rank, [first, second]) in out.into_iter().enumerate() {
        let first = first.unwrap_or_else(|e| panic!("rank {rank}: the forward failed: {e}"));
        assert!(
            all_nan(&first.hidden) && all_nan(&first.weight),
            "rank {rank}"
        );
        let expected = injected("deferred exchange failure");
        assert_eq!(second.map(|_| ()).unwrap_err(), expected, "rank {rank}");
    }
}

#[test]
fn a_tensor_exchange_timeout_fails_that_call_on_every_rank() {
    let p = problem([4, 8, 64], DType::F32, false, None, 33);
    let late = Fault::Late {
        at: 0,
        delay: Duration::from_millis(1500),
    };
    let (out, took) = two_steps(
        &p,
        &[Fault::Healthy, Fault::Healthy, late],
        Duration::from_millis(300),
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
    let errors: Vec<InvariantError> = out
        .into_iter()
        .map(|[first, second]| {
            let first = first.map(|_| ()).unwrap_err();
            assert_eq!(second.map(|_| ()).unwrap_err(), first);
            first
        })
        .collect();
    assert!(
        matches!(&errors[0], InvariantError::Collective { reason } if reason.contains("[2]")),
        "{}",
        errors[0]
    );
    assert!(errors.iter().all(|e| e == &errors[0]), "{errors:?}");
}

#[test]
fn a_group_reporting_the_tensors_device_passes_validation() {
    let p = Arc::new(problem([4, 8, 64], DType::F32, true, None, 34));
    let groups = InProcessGroup::new(2)
        .into_iter()
        .map(|g| Faulty::new(g, Fault::Healthy, Some(burn_ndarray::NdArrayDevice::Cpu)))
        .collect();
    let q = p.clone();
    let outs = ranks::on_ranks(groups, WATCHDOG, move |rank, group| {
        rank_run::<AD, _>(
            &q,
            &Default::default(),
            VocabShard::split(rank, 2, q.v),
            &group,
        )
    });
    assert_ranks_agree("device reported", &outs);
}

/// The same algorithm on wgpu (lavapipe in CI), where the per-row steps are the CubeCL kernels
/// of `burn_invariant_cubecl::tp` (raw `CubeBackend`) or fused Burn ops (`Fusion`).
#[cfg(feature = "wgpu")]
mod wgpu {
    use std::sync::OnceLock;

    use burn::tensor::{Int, Tensor, TensorPrimitive};
    use burn_invariant::InvariantBackend;
    use burn_wgpu::{WgpuDevice, WgpuRuntime};
    use serial_test::serial;

    use super::*;

    type Raw = burn_cubecl::CubeBackend<WgpuRuntime, f32, i32, u32>;
    type Fused = burn_fusion::Fusion<Raw>;

    fn device() -> Option<WgpuDevice> {
        static CELL: OnceLock<Option<WgpuDevice>> = OnceLock::new();
        common::probe(&CELL, "wgpu", "BURN_INVARIANT_REQUIRE_WGPU", || {
            let device = WgpuDevice::DefaultDevice;
            // Creating the client panics when no adapter exists.
            let _ = <WgpuRuntime as cubecl::Runtime>::client(&device);
            Some(device)
        })
    }

    fn run_on<X>(p: &Problem, shards: &[VocabShard], device: &X::Device) -> Vec<RankOut>
    where
        X: burn::tensor::backend::AutodiffBackend + InvariantBackend,
    {
        let (p, shards, device) = (Arc::new(p.clone()), shards.to_vec(), device.clone());
        ranks::on_ranks(
            InProcessGroup::new(shards.len()),
            WATCHDOG,
            move |rank, group| rank_run::<X, _>(&p, &device, shards[rank], &group),
        )
    }

    /// Worlds 1, 2, 4 bitwise equal to each other, and the single-rank NdArray API within f32
    /// rounding; `ignore_index`, bias and an unchecked out-of-range target included.
    fn invariant_and_correct<X>(device: &X::Device)
    where
        X: burn::tensor::backend::AutodiffBackend + InvariantBackend,
    {
        for (shape, with_bias, ignore_every, seed, head) in [
            ([13, 24, 600], true, Some(4), 21, None),
            ([9, 16, 2100], false, None, 22, None),
            ([13, 24, 600], true, Some(4), 23, Some(0.7)),
        ] {
            let mut p = problem(shape, DType::F32, with_bias, ignore_every, seed);
            p.targets[1] = p.v as i64; // NaN, like the single-rank API
            p.options.skip_target_check = true;
            if let Some(t) = head {
                p.options = p.options.with_temperature(t).with_entropy(true);
            }
            let single = single_rank::<AD>(&p, &Default::default());
            let reference = run_on::<X>(&p, &split(1, p.v), device);
            assert_matches_single_rank("world 1", &reference, &single);
            assert!(
                reference[0].logp[1].is_nan(),
                "out-of-range target gives NaN"
            );
            for world in [2, 4] {
                let outs = run_on::<X>(&p, &split(world, p.v), device);
                let what = format!("V={} world={world}", p.v);
                assert_ranks_agree(&what, &outs);
                let no_entropy = Vec::new();
                let entropy = |o: &RankOut| o.entropy.clone().unwrap_or_default();
                let (got_h, ref_h) = match head {
                    Some(_) => (entropy(&outs[0]), entropy(&reference[0])),
                    None => (no_entropy.clone(), no_entropy),
                };
                for (name, got, expected) in [
                    ("logp", &outs[0].logp, &reference[0].logp),
                    ("lse", &outs[0].lse, &reference[0].lse),
                    ("entropy", &got_h, &ref_h),
                    ("dHidden", &outs[0].hidden, &reference[0].hidden),
                ] {
                    assert_bits_eq(
                        &format!("{what}: {name} vs world 1"),
                        &bits_of(got),
                        &bits_of(expected),
                    );
                }
            }
        }
    }

    #[test]
    #[serial]
    fn raw_cube_backend_tp_is_invariant_and_correct() {
        let Some(device) = device() else { return };
        invariant_and_correct::<burn::backend::Autodiff<Raw>>(&device);
    }

    #[test]
    #[serial]
    fn fusion_tp_is_invariant_and_correct() {
        let Some(device) = device() else { return };
        invariant_and_correct::<burn::backend::Autodiff<Fused>>(&device);
    }

    fn floats<X: InvariantBackend>(values: &[f32], device: &X::Device) -> Tensor<X, 1> {
        float::<X, 1>(values.to_vec(), [values.len()], device, DType::F32)
    }

    fn prim<X: InvariantBackend, const D: usize>(
        t: Tensor<X, D>,
    ) -> burn::tensor::ops::FloatTensor<X> {
        t.into_primitive().tensor()
    }

    fn back<X: InvariantBackend, const D: usize>(t: burn::tensor::ops::FloatTensor<X>) -> Vec<f32> {
        host(Tensor::<X, D>::from_primitive(TensorPrimitive::Float(t)))
    }

    fn int_values<X: InvariantBackend>(t: burn::tensor::ops::IntTensor<X>) -> Vec<i64> {
        Tensor::<X, 1, Int>::from_primitive(t)
            .into_data()
            .iter::<i64>()
            .collect()
    }

    /// Each kernel against the Burn-op default on NdArray: bitwise for the selections and the
    /// remap, within a few ulps for the merge (exp and log1p are the device's); the merge's
    /// special cases exactly.
    #[test]
    #[serial]
    fn tp_kernels_match_the_burn_op_reference() {
        let Some(device) = device() else { return };
        let cpu = Default::default();
        let targets: Vec<i64> = vec![-100, 0, 4, 5, 9, 10, 11, -2, -1, 7, 1 << 20, 5];
        for (start, end, ignore) in [
            (5, 10, Some(-100)),
            (0, 5, None),
            (10, 12, Some(7)),
            (1 << 40, 1 << 41, Some(5)),
        ] {
            let got = int_values::<Raw>(Raw::invariant_tp_leaf_targets(
                ints::<Raw>(targets.clone(), &device).into_primitive(),
                start,
                end,
                ignore,
            ));
            let want = int_values::<B>(B::invariant_tp_leaf_targets(
                ints::<B>(targets.clone(), &cpu).into_primitive(),
                start,
                end,
                ignore,
            ));
            assert_eq!(got, want, "leaf [{start}, {end}) ignore {ignore:?}");
        }

        let inf = f32::INFINITY;
        let a = [
            0.5f32,
            -3.0,
            7.25,
            -inf,
            inf,
            -inf,
            f32::NAN,
            2.0,
            80.0,
            -1e-3,
            1.5,
        ];
        let b = [
            0.25f32,
            12.0,
            7.25,
            3.5,
            inf,
            -inf,
            1.0,
            f32::NAN,
            -20.0,
            1e-3,
            -inf,
        ];
        let got = back::<Raw, 1>(Raw::invariant_tp_merge_lse(
            prim(floats::<Raw>(&a, &device)),
            prim(floats::<Raw>(&b, &device)),
        ));
        let want = back::<B, 1>(B::invariant_tp_merge_lse(
            prim(floats::<B>(&a, &cpu)),
            prim(floats::<B>(&b, &cpu)),
        ));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let exact = !a[i].is_finite() || !b[i].is_finite();
            let ok = if exact {
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan())
            } else {
                (g - w).abs() <= 4.0 * f32::EPSILON * w.abs().max(1.0)
            };
            assert!(ok, "merge_lse({}, {}): got {g}, expected {w}", a[i], b[i]);
        }
        assert_eq!(got[3], 3.5, "-inf ⊕ x = x");
        assert_eq!(got[4], inf, "inf ⊕ inf = inf");
        assert_eq!(got[5], -inf, "-inf ⊕ -inf = -inf");
        assert!(got[6].is_nan() && got[7].is_nan(), "NaN propagates");

        // The (lse, entropy) merge: the lse row bitwise the lse merge's, the entropy row within a
        // few ulps of the Burn ops; an empty side (lse −∞) adds exactly nothing.
        let (ha, hb): (Vec<f32>, Vec<f32>) = (0..a.len())
            .map(|i| (0.1 + i as f32 * 0.3, 2.0 - i as f32 * 0.1))
            .unzip();
        let pair = |x: &[f32], h: &[f32]| [x, h].concat();
        let m = a.len();
        let got_pair = back::<Raw, 2>(Raw::invariant_tp_merge_entropy(
            prim(float::<Raw, 2>(pair(&a, &ha), [2, m], &device, DType::F32)),
            prim(float::<Raw, 2>(pair(&b, &hb), [2, m], &device, DType::F32)),
        ));
        let want_pair = back::<B, 2>(B::invariant_tp_merge_entropy(
            prim(float::<B, 2>(pair(&a, &ha), [2, m], &cpu, DType::F32)),
            prim(float::<B, 2>(pair(&b, &hb), [2, m], &cpu, DType::F32)),
        ));
        assert_eq!(
            bits_of(&got_pair[..m]),
            bits_of(&got),
            "merge_entropy's lse row is merge_lse"
        );
        for i in 0..m {
            let (g, w) = (got_pair[m + i], want_pair[m + i]);
            let ok = (g - w).abs() <= 8.0 * f32::EPSILON * w.abs().max(1.0)
                || (g.is_nan() && w.is_nan());
            assert!(ok, "merge_entropy entropy {i}: got {g}, expected {w}");
        }
        assert_eq!(
            got_pair[m + 3],
            hb[3],
            "an empty side adds nothing to the entropy"
        );
        assert_eq!(
            got_pair[m + 10],
            ha[10],
            "an empty side adds nothing to the entropy"
        );

        let n = targets.len();
        let stats: Vec<f32> = (0..2 * n).map(|i| i as f32 * 0.5 - 3.0).collect();
        let acc: Vec<f32> = (0..2 * n).map(|i| -(i as f32) - 0.25).collect();
        let lse: Vec<f32> = (0..n).map(|i| i as f32 * 0.75 + 0.5).collect();
        let leaf = |start: usize, end: usize| {
            (
                Raw::invariant_tp_leaf_targets(
                    ints::<Raw>(targets.clone(), &device).into_primitive(),
                    start,
                    end,
                    Some(-100),
                ),
                B::invariant_tp_leaf_targets(
                    ints::<B>(targets.clone(), &cpu).into_primitive(),
                    start,
                    end,
                    Some(-100),
                ),
            )
        };
        let two = |v: &[f32], d: &WgpuDevice| float::<Raw, 2>(v.to_vec(), [2, n], d, DType::F32);
        let two_cpu = |v: &[f32]| float::<B, 2>(v.to_vec(), [2, n], &cpu, DType::F32);
        let stats_of =
            |v: &[f32], d: &WgpuDevice| float::<Raw, 2>(v.to_vec(), [n, 2], d, DType::F32);
        for with_acc in [false, true] {
            let (leaf_raw, leaf_cpu) = leaf(4, 10);
            let got = back::<Raw, 2>(Raw::invariant_tp_pick(
                with_acc.then(|| prim(two(&acc, &device))),
                prim(stats_of(&stats, &device)),
                leaf_raw,
            ));
            let want = back::<B, 2>(B::invariant_tp_pick(
                with_acc.then(|| prim(two_cpu(&acc))),
                prim(float::<B, 2>(stats.clone(), [n, 2], &cpu, DType::F32)),
                leaf_cpu,
            ));
            assert_bits_eq(
                &format!("pick (acc {with_acc})"),
                &bits_of(&got),
                &bits_of(&want),
            );
        }
        for (vocab, ignore) in [(11, Some(-100)), (12, None), (usize::MAX, Some(7))] {
            let got = back::<Raw, 2>(Raw::invariant_tp_finish(
                prim(two(&stats, &device)),
                prim(floats::<Raw>(&lse, &device)),
                ints::<Raw>(targets.clone(), &device).into_primitive(),
                vocab,
                ignore,
            ));
            let want = back::<B, 2>(B::invariant_tp_finish(
                prim(two_cpu(&stats)),
                prim(floats::<B>(&lse, &cpu)),
                ints::<B>(targets.clone(), &cpu).into_primitive(),
                vocab,
                ignore,
            ));
            assert_bits_eq(
                &format!("finish V={vocab}"),
                &bits_of(&got),
                &bits_of(&want),
            );
        }
    }

    /// A rank whose tensors are not on its group's device fails validation on every rank,
    /// at once rather than after the group's timeout.
    #[test]
    #[serial]
    fn tensors_off_the_groups_device_fail_every_rank() {
        let Some(device) = device() else { return };
        let p = Arc::new(problem([4, 8, 64], DType::F32, false, None, 35));
        let groups = InProcessGroup::with_timeout(2, Duration::from_secs(60))
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                // An adapter index no machine has: never allocated on, only compared.
                let reported = (rank == 1).then_some(WgpuDevice::DiscreteGpu(99));
                Faulty::new(g, Fault::Healthy, Some(reported.unwrap_or(device.clone())))
            })
            .collect();
        let start = Instant::now();
        let errors = ranks::on_ranks(groups, WATCHDOG, move |rank, group| {
            let s = VocabShard::split(rank, 2, p.v);
            shard_logp::<Raw, _>(&p, &device, &s, &group).unwrap_err()
        });
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "took {:?}",
            start.elapsed()
        );
        assert_eq!(errors[0], errors[1]);
        assert!(
            matches!(&errors[0], InvariantError::RankFailed { rank: 1, reason, .. }
                if reason.contains("DiscreteGpu(99)")),
            "{}",
            errors[0]
        );
    }
}
