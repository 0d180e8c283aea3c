//! The segment algorithm on one backend (never `Autodiff`: [`super::autodiff`] wraps it).
//!
//! Every leaf (a segment, or the piece of one that a rank holds) is one call of the
//! single-rank primitives on that slice of the weight, with the targets remapped: rows whose
//! target lies in the leaf get its local index, ignored rows the ignore sentinel, every other
//! row −2 (no column of this leaf). A leaf's computation therefore does not depend on which
//! rank runs it.
use burn::tensor::{
    DType, Tensor, TensorPrimitive,
    ops::{FloatTensor, IntTensor},
};

use super::{Collective, Plan};
use crate::InvariantError;
use crate::backend::{GradRequest, InvariantBackend, LinearLogpGrads, LinearLogpInputs};
use crate::registry::Implementation;

/// Phase timings for profiling (`BURN_INVARIANT_TP_TRACE=1`): each mark waits for the device
/// and prints the time since the previous mark. The variable is read once per process.
pub(crate) struct Trace<'a, B: InvariantBackend> {
    device: &'a B::Device,
    last: Option<std::time::Instant>,
}

impl<'a, B: InvariantBackend> Trace<'a, B> {
    pub(crate) fn start(device: &'a B::Device) -> Self {
        static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let enabled = *ENABLED
            .get_or_init(|| std::env::var("BURN_INVARIANT_TP_TRACE").is_ok_and(|v| v == "1"));
        let mut trace = Self { device, last: None };
        if enabled {
            let _ = B::sync(device);
            trace.last = Some(std::time::Instant::now());
        }
        trace
    }

    pub(crate) fn mark(&mut self, phase: &str) {
        if let Some(last) = self.last {
            let _ = B::sync(self.device);
            let now = std::time::Instant::now();
            eprintln!(
                "tp-trace {phase}: {:.3} ms",
                (now - last).as_secs_f64() * 1e3
            );
            self.last = Some(now);
        }
    }
}

/// The ignore index of the leaf calls: every leaf sees a row's target as its local index
/// (the leaf owns it), −1 (ignored) or −2 (it lies in another leaf: no column of this one).
const SENTINEL: i64 = -1;

pub(crate) fn wrap<B: InvariantBackend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

pub(crate) fn raw<B: InvariantBackend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn merge_lse<B: InvariantBackend>(a: Tensor<B, 1>, b: Tensor<B, 1>) -> Tensor<B, 1> {
    wrap(B::invariant_tp_merge_lse(raw(a), raw(b)))
}

/// One rank's inputs.
struct Ctx<B: InvariantBackend> {
    hidden: FloatTensor<B>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    targets: IntTensor<B>,
    ignore_index: Option<i64>,
    offset: usize,
    n: usize,
    d: usize,
    device: B::Device,
    implementation: Implementation,
}

impl<B: InvariantBackend> Ctx<B> {
    fn new(inputs: LinearLogpInputs<B>, plan: &Plan, implementation: Implementation) -> Self {
        let hidden: Tensor<B, 2> = wrap(inputs.hidden.clone());
        let [n, d] = hidden.dims();
        Self {
            hidden: inputs.hidden,
            weight: wrap(inputs.weight),
            bias: inputs.bias.map(wrap),
            targets: inputs.targets,
            ignore_index: inputs.ignore_index,
            offset: plan.shard().0,
            n,
            d,
            device: hidden.device(),
            implementation,
        }
    }

    fn f32_full(&self, value: f32) -> Tensor<B, 1> {
        Tensor::full([self.n], value, (&self.device, DType::F32))
    }

    /// The leaf `[start, end)` (global rows) as single-rank primitive inputs.
    fn leaf_inputs(&self, start: usize, end: usize) -> LinearLogpInputs<B> {
        let (a, b) = (start - self.offset, end - self.offset);
        LinearLogpInputs {
            hidden: self.hidden.clone(),
            weight: raw(self.weight.clone().slice([a..b, 0..self.d])),
            bias: self.bias.clone().map(|bias| raw(bias.slice(a..b))),
            targets: B::invariant_tp_leaf_targets(
                self.targets.clone(),
                start,
                end,
                self.ignore_index,
            ),
            ignore_index: Some(SENTINEL),
        }
    }
}

/// Forward on one rank: `[N, 2]` f32 `(logp, lse)`, identical on every rank.
pub(crate) fn forward<B: InvariantBackend, G: Collective<B>>(
    inputs: LinearLogpInputs<B>,
    plan: &Plan,
    group: &G,
    implementation: Implementation,
) -> Result<FloatTensor<B>, InvariantError> {
    let ctx = Ctx::new(inputs, plan, implementation);
    let device = ctx.device.clone();
    let mut trace = Trace::<B>::start(&device);
    let n = ctx.n;
    if n == 0 {
        // Every rank has N = 0 (validated), so every rank skips the exchange.
        return Ok(raw(Tensor::<B, 2>::zeros(
            [0, 2],
            (&ctx.device, DType::F32),
        )));
    }
    // The owning leaf's (logp, lse) rows `[2, N]`, zero where this rank owns no target: exactly
    // one leaf of one rank owns a row, so the sum over ranks below is exact in any order.
    let mut picks: Option<FloatTensor<B>> = None;
    let mut leaf = |start: usize, end: usize| {
        let inputs = ctx.leaf_inputs(start, end);
        let leaf_targets = inputs.targets.clone();
        let stats = B::invariant_linear_logp(inputs, ctx.implementation);
        picks = Some(B::invariant_tp_pick(
            picks.take(),
            stats.clone(),
            leaf_targets,
        ));
        wrap::<B, 2>(stats).slice([0..n, 1..2]).reshape([n])
    };
    let identity = || ctx.f32_full(f32::NEG_INFINITY);
    let mut rows: Vec<Tensor<B, 2>> = plan
        .local_items()
        .iter()
        .map(|&item| {
            plan.eval_item(item, &mut leaf, &identity, &merge_lse::<B>)
                .unsqueeze_dim(0)
        })
        .collect();
    let block = plan.block();
    if rows.len() < block {
        rows.push(Tensor::zeros(
            [block - rows.len(), n],
            (&device, DType::F32),
        ));
    }
    // A rank holds at least one leaf (shards are non-empty).
    rows.push(picks.map_or_else(|| Tensor::zeros([2, n], (&device, DType::F32)), wrap));
    let world = plan.world();
    let mine: Tensor<B, 2> = Tensor::cat(rows, 0);
    trace.mark("forward leaves");
    let all = group
        .all_gather(mine.reshape([(block + 2) * n]))?
        .reshape([world, block + 2, n]);
    trace.mark("forward exchange");
    let row = |rank: usize, index: usize| {
        all.clone()
            .slice([rank..rank + 1, index..index + 1, 0..n])
            .reshape([n])
    };
    let lse = plan.eval_global(&row, &identity, &merge_lse::<B>);
    let picks_of = |rank: usize| {
        all.clone()
            .slice([rank..rank + 1, block..block + 2, 0..n])
            .reshape([2, n])
    };
    let picks = (1..world).fold(picks_of(0), |acc, rank| acc + picks_of(rank));
    let global_vocab = plan.shards[world - 1].1;
    let stats = B::invariant_tp_finish(
        raw(picks),
        raw(lse),
        ctx.targets.clone(),
        global_vocab,
        ctx.ignore_index,
    );
    trace.mark("forward combine");
    Ok(stats)
}

/// Backward on one rank from the forward's `stats [N, 2]` and the upstream `grad [N, 2]`.
/// `dWeight`/`dBias` are this rank's shard; `dHidden` is combined over ranks in tree order
/// (one all-gather, only when requested).
pub(crate) fn backward<B: InvariantBackend, G: Collective<B>>(
    inputs: LinearLogpInputs<B>,
    stats: FloatTensor<B>,
    grad: FloatTensor<B>,
    request: GradRequest,
    plan: &Plan,
    group: &G,
    implementation: Implementation,
) -> Result<LinearLogpGrads<B>, InvariantError> {
    let hidden_dtype = wrap::<B, 2>(inputs.hidden.clone()).dtype();
    let has_bias = inputs.bias.is_some();
    let ctx = Ctx::new(inputs, plan, implementation);
    let device = ctx.device.clone();
    let mut trace = Trace::<B>::start(&device);
    let n = ctx.n;
    if n == 0 {
        // No rows, no exchange (N = 0 on every rank): all gradients are zero.
        let zeros = |t: &Tensor<B, 2>| raw(t.zeros_like());
        return Ok(LinearLogpGrads {
            hidden: request.hidden.then(|| zeros(&wrap(ctx.hidden.clone()))),
            weight: request.weight.then(|| zeros(&ctx.weight)),
            bias: ctx
                .bias
                .as_ref()
                .filter(|_| request.bias)
                .map(|b| raw(b.zeros_like())),
        });
    }
    // The leaves read only the lse column of `stats`: the global lse. A row whose target lies
    // in another leaf matches no column of this one, so its dz there is (dLse − dLogp)·p (SPEC
    // §4's dz without the one-hot term); ignored rows drop dLogp in every leaf.
    let grad = raw(wrap::<B, 2>(grad).cast(DType::F32));
    let leaf_request = GradRequest {
        bias: request.bias && has_bias,
        ..request
    };
    let mut weights = Vec::new();
    let mut biases = Vec::new();
    let mut leaf = |start: usize, end: usize| {
        let grads = B::invariant_linear_logp_backward(
            ctx.leaf_inputs(start, end),
            stats.clone(),
            grad.clone(),
            leaf_request,
            ctx.implementation,
        );
        weights.extend(grads.weight.map(wrap::<B, 2>));
        biases.extend(grads.bias.map(wrap::<B, 1>));
        grads.hidden.map(|h| wrap::<B, 2>(h).cast(DType::F32))
    };
    let identity = || {
        request
            .hidden
            .then(|| Tensor::<B, 2>::zeros([n, ctx.d], (&ctx.device, DType::F32)))
    };
    let add = |a: Option<Tensor<B, 2>>, b: Option<Tensor<B, 2>>| match (a, b) {
        (Some(a), Some(b)) => Some(a + b),
        _ => None,
    };
    let partials: Vec<Option<Tensor<B, 2>>> = plan
        .local_items()
        .iter()
        .map(|&item| plan.eval_item(item, &mut leaf, &identity, &add))
        .collect();
    let hidden = if request.hidden {
        let (block, world, d) = (plan.block(), plan.world(), ctx.d);
        let mut rows: Vec<Tensor<B, 2>> = partials.into_iter().flatten().collect();
        rows.resize_with(block, || Tensor::zeros([n, d], (&ctx.device, DType::F32)));
        // A single item (segment-aligned shards, world ≥ 2): a view, not a 4·N·D-byte copy.
        let mine: Tensor<B, 3> = match <[_; 1]>::try_from(rows) {
            Ok([row]) => row.unsqueeze_dim(0),
            Err(rows) => Tensor::stack(rows, 0),
        };
        trace.mark("backward leaves");
        let all = group
            .all_gather(mine.reshape([block * n * d]))?
            .reshape([world, block, n, d]);
        trace.mark("backward exchange");
        let get = |rank: usize, index: usize| {
            Some(
                all.clone()
                    .slice([rank..rank + 1, index..index + 1, 0..n, 0..d])
                    .reshape([n, d]),
            )
        };
        plan.eval_global(&get, &identity, &add)
            .map(|h| raw(h.cast(hidden_dtype)))
    } else {
        None
    };
    let cat = |parts: Vec<Tensor<B, 2>>| match parts.len() {
        0 => None,
        1 => parts.into_iter().next().map(raw),
        _ => Some(raw(Tensor::cat(parts, 0))),
    };
    let bias = match biases.len() {
        0 => None,
        1 => biases.into_iter().next().map(raw),
        _ => Some(raw(Tensor::cat(biases, 0))),
    };
    let weight = cat(weights);
    trace.mark("backward combine");
    Ok(LinearLogpGrads {
        hidden,
        weight,
        bias,
    })
}
