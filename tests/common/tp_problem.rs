//! The shared problem of the tensor-parallel tests (CPU and NCCL): host data every rank builds
//! its tensors from, and one forward + backward through `tp` or the single-rank API.
use burn::tensor::{DType, Int, Tensor, backend::AutodiffBackend};
use burn_invariant::tp::{self, VocabShard};
use burn_invariant::{InvariantBackend, LinearLogpOptions, LinearLogpOutput};

use super::{Rng, float, ints, matrix_rows};

pub const IGNORE: i64 = -100;

#[derive(Clone)]
pub struct Problem {
    pub n: usize,
    pub d: usize,
    pub v: usize,
    pub dtype: DType,
    pub hidden: Vec<f32>,
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    pub targets: Vec<i64>,
    pub g_logp: Vec<f32>,
    pub g_lse: Vec<f32>,
    /// The entropy's upstream gradient (used when `options.entropy`).
    pub g_ent: Vec<f32>,
    pub options: LinearLogpOptions,
}

/// Random data; with `ignore_every = Some(k)` every k-th target is [`IGNORE`].
pub fn problem(
    [n, d, v]: [usize; 3],
    dtype: DType,
    with_bias: bool,
    ignore_every: Option<usize>,
    seed: u64,
) -> Problem {
    let mut rng = Rng::new(seed);
    let scale = 3.0 / (d as f32).sqrt();
    let targets = (0..n)
        .map(|i| match ignore_every {
            Some(every) if i % every == every - 1 => IGNORE,
            _ => rng.below(v) as i64,
        })
        .collect();
    Problem {
        n,
        d,
        v,
        dtype,
        hidden: rng.vec(n * d, 1.0),
        weight: rng.vec(v * d, scale),
        bias: with_bias.then(|| rng.vec(v, 1.0)),
        targets,
        g_logp: rng.vec(n, 1.0),
        g_lse: rng.vec(n, 1.0),
        g_ent: rng.vec(n, 0.5),
        options: LinearLogpOptions {
            ignore_index: ignore_every.map(|_| IGNORE),
            ..Default::default()
        },
    }
}

/// One run's results, as host f32 values.
#[derive(Debug, Clone)]
pub struct RankOut {
    pub logp: Vec<f32>,
    pub lse: Vec<f32>,
    /// With `options.entropy`.
    pub entropy: Option<Vec<f32>>,
    pub hidden: Vec<f32>,
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
}

pub fn host<const D: usize, B: burn::tensor::backend::Backend>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().to_vec().unwrap()
}

/// Forward and backward of `Σ g_logp·logp + g_lse·lse (+ g_ent·entropy)` with `op` (hidden,
/// weight, targets, bias → outputs) on weight rows `rows`.
fn run<A>(
    p: &Problem,
    device: &A::Device,
    rows: core::ops::Range<usize>,
    op: impl FnOnce(
        Tensor<A, 2>,
        Tensor<A, 2>,
        Tensor<A, 1, Int>,
        Option<Tensor<A, 1>>,
    ) -> LinearLogpOutput<A>,
) -> RankOut
where
    A: AutodiffBackend + InvariantBackend,
{
    let len = rows.len();
    let hidden = float::<A, 2>(p.hidden.clone(), [p.n, p.d], device, p.dtype).require_grad();
    let weight = matrix_rows::<A>(&p.weight, p.d, rows.clone(), device, p.dtype).require_grad();
    let bias = p
        .bias
        .as_ref()
        .map(|b| float::<A, 1>(b[rows].to_vec(), [len], device, p.dtype).require_grad());
    let targets = ints::<A>(p.targets.clone(), device);
    let out = op(hidden.clone(), weight.clone(), targets, bias.clone());
    let (logp, lse) = (out.logp, out.lse);
    let g = |values: &Vec<f32>| float::<A, 1>(values.clone(), [p.n], device, DType::F32);
    let mut loss = logp.clone() * g(&p.g_logp) + lse.clone() * g(&p.g_lse);
    if let Some(entropy) = &out.entropy {
        loss = loss + entropy.clone() * g(&p.g_ent);
    }
    let grads = loss.sum().backward();
    RankOut {
        logp: host(logp.inner()),
        lse: host(lse.inner()),
        entropy: out.entropy.map(|e| host(e.inner())),
        hidden: host(hidden.grad(&grads).expect("hidden grad")),
        weight: host(weight.grad(&grads).expect("weight grad")),
        bias: bias.map(|b| host(b.grad(&grads).expect("bias grad"))),
    }
}

/// One rank of `tp::linear_logp_full` (with `options.entropy`) or `tp::linear_logp_with_lse` on
/// `shard`.
pub fn rank_run<A, G>(p: &Problem, device: &A::Device, shard: VocabShard, group: &G) -> RankOut
where
    A: AutodiffBackend + InvariantBackend,
    G: tp::Collective<A> + Clone + 'static,
{
    run::<A>(p, device, shard.range(), |hidden, weight, targets, bias| {
        let opts = &p.options;
        if opts.entropy {
            tp::linear_logp_full(hidden, weight, targets, bias, &shard, group, opts)
                .expect("tp::linear_logp_full")
        } else {
            let (logp, lse) =
                tp::linear_logp_with_lse(hidden, weight, targets, bias, &shard, group, opts)
                    .expect("tp::linear_logp_with_lse");
            LinearLogpOutput {
                logp,
                lse,
                entropy: None,
            }
        }
    })
}

/// One rank's plain `tp::linear_logp` on `shard` (f32, no bias), its result as it is.
pub fn shard_logp<B, G>(
    p: &Problem,
    device: &B::Device,
    shard: &VocabShard,
    group: &G,
) -> Result<Tensor<B, 1>, burn_invariant::InvariantError>
where
    B: InvariantBackend,
    G: tp::Collective<B> + Clone + 'static,
{
    tp::linear_logp(
        float::<B, 2>(p.hidden.clone(), [p.n, p.d], device, DType::F32),
        matrix_rows::<B>(&p.weight, p.d, shard.range(), device, DType::F32),
        ints::<B>(p.targets.clone(), device),
        None,
        shard,
        group,
        &p.options,
    )
}

/// The single-rank `linear_logp_full` on the whole head.
pub fn single_rank<A>(p: &Problem, device: &A::Device) -> RankOut
where
    A: AutodiffBackend + InvariantBackend,
{
    run::<A>(p, device, 0..p.v, |hidden, weight, targets, bias| {
        burn_invariant::linear_logp_full(hidden, weight, targets, bias, &p.options)
            .expect("linear_logp_full")
    })
}
