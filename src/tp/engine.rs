//! The segment algorithm on one backend, as a [`CollectiveLogp`] (`Autodiff` runs it on its
//! inner backend and records its backward).
//!
//! Every leaf (a segment, or the piece of one that a rank holds) is one call of the
//! single-rank primitives on that slice of the weight, with the targets remapped: rows whose
//! target lies in the leaf get its local index, ignored rows the ignore sentinel, every other
//! row −2 (no column of this leaf). A leaf's computation therefore does not depend on which
//! rank runs it.
use burn::tensor::{
    DType, Int, Tensor,
    ops::{FloatTensor, IntTensor},
};

use super::Plan;
use super::trace::Trace;
use crate::InvariantError;
use crate::backend::{
    Collective, CollectiveLogp, GradRequest, InvariantBackend, LinearLogpGrads, LinearLogpInputs,
    LogpHead,
};
use crate::backends::generic::{float_primitive, float_tensor};
use crate::registry::Implementation;

/// The engine of one validated call: the plan of this rank and the implementation every
/// leaf runs.
#[derive(Debug, Clone)]
pub(crate) struct Engine {
    plan: Plan,
    implementation: Implementation,
}

impl Engine {
    pub(crate) fn new(plan: Plan, implementation: Implementation) -> Self {
        Self {
            plan,
            implementation,
        }
    }
}

impl CollectiveLogp for Engine {
    fn forward<B: InvariantBackend, G: Collective<B>>(
        &self,
        inputs: LinearLogpInputs<B>,
        group: &G,
    ) -> Result<FloatTensor<B>, InvariantError> {
        forward(inputs, &self.plan, group, self.implementation)
    }

    fn backward<B: InvariantBackend, G: Collective<B>>(
        &self,
        inputs: LinearLogpInputs<B>,
        stats: FloatTensor<B>,
        grad: FloatTensor<B>,
        request: GradRequest,
        group: &G,
    ) -> Result<LinearLogpGrads<B>, InvariantError> {
        let ctx = Ctx::new(inputs, &self.plan, self.implementation);
        backward(&ctx, stats, grad, request, &self.plan, group)
    }
}

/// The ignore index of the leaf calls: every leaf sees a row's target as its local index
/// (the leaf owns it), −1 (ignored) or −2 (it lies in another leaf: no column of this one).
const SENTINEL: i64 = -1;

/// The combine of the tree over `[k, N]` values: the lse row (`k = 1`), or `(lse, entropy)`
/// rows (`k = 2`, with entropy).
fn merge_stats<B: InvariantBackend>(a: Tensor<B, 2>, b: Tensor<B, 2>) -> Tensor<B, 2> {
    let [k, n] = a.dims();
    if k == 1 {
        let merged: Tensor<B, 1> = float_tensor(B::invariant_tp_merge_lse(
            float_primitive(a.reshape([n])),
            float_primitive(b.reshape([n])),
        ));
        merged.reshape([1, n])
    } else {
        float_tensor(B::invariant_tp_merge_entropy(
            float_primitive(a),
            float_primitive(b),
        ))
    }
}

/// One rank's inputs.
struct Ctx<B: InvariantBackend> {
    hidden: FloatTensor<B>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    targets: IntTensor<B>,
    ignore_index: Option<i64>,
    head: LogpHead,
    offset: usize,
    n: usize,
    d: usize,
    device: B::Device,
    implementation: Implementation,
}

impl<B: InvariantBackend> Ctx<B> {
    fn new(inputs: LinearLogpInputs<B>, plan: &Plan, implementation: Implementation) -> Self {
        let hidden: Tensor<B, 2> = float_tensor(inputs.hidden.clone());
        let [n, d] = hidden.dims();
        Self {
            hidden: inputs.hidden,
            weight: float_tensor(inputs.weight),
            bias: inputs.bias.map(float_tensor),
            targets: inputs.targets,
            ignore_index: inputs.ignore_index,
            head: inputs.head,
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

    /// Rows of a tree value: the lse, then the entropy when requested.
    fn tree_rows(&self) -> usize {
        1 + usize::from(self.head.entropy)
    }

    /// The identity of the tree's combine: lse −∞ (and entropy 0), `[k, N]`.
    fn tree_identity(&self) -> Tensor<B, 2> {
        let lse = self.f32_full(f32::NEG_INFINITY).unsqueeze_dim(0);
        if self.head.entropy {
            Tensor::cat(vec![lse, self.f32_full(0.0).unsqueeze_dim(0)], 0)
        } else {
            lse
        }
    }

    fn f32_zeros_nd(&self) -> Tensor<B, 2> {
        Tensor::zeros([self.n, self.d], (&self.device, DType::F32))
    }

    /// The leaf `[start, end)` (global rows) as single-rank primitive inputs.
    fn leaf_inputs(&self, start: usize, end: usize) -> LinearLogpInputs<B> {
        let (a, b) = (start - self.offset, end - self.offset);
        LinearLogpInputs {
            hidden: self.hidden.clone(),
            weight: float_primitive(self.weight.clone().slice([a..b, 0..self.d])),
            bias: self
                .bias
                .clone()
                .map(|bias| float_primitive(bias.slice(a..b))),
            targets: B::invariant_tp_leaf_targets(
                self.targets.clone(),
                start,
                end,
                self.ignore_index,
            ),
            ignore_index: Some(SENTINEL),
            head: self.head,
        }
    }
}

/// Forward on one rank: `[N, C]` f32 `(logp, lse[, entropy])`, identical on every rank.
fn forward<B: InvariantBackend, G: Collective<B>>(
    inputs: LinearLogpInputs<B>,
    plan: &Plan,
    group: &G,
    implementation: Implementation,
) -> Result<FloatTensor<B>, InvariantError> {
    let ctx = Ctx::new(inputs, plan, implementation);
    let mut trace = Trace::<B>::start(&ctx.device);
    if ctx.n == 0 {
        // Every rank has N = 0 (validated), so every rank skips the exchange.
        return Ok(float_primitive(Tensor::<B, 2>::zeros(
            [0, ctx.head.columns()],
            (&ctx.device, DType::F32),
        )));
    }
    let mine = forward_leaves(&ctx, plan);
    trace.mark("forward leaves");
    let (rows, world, n) = (plan.block() * ctx.tree_rows() + 2, plan.world(), ctx.n);
    let all = group
        .all_gather(mine.reshape([rows * n]))?
        .reshape([world, rows, n]);
    trace.mark("forward exchange");
    let stats = forward_combine(&ctx, plan, all);
    trace.mark("forward combine");
    // An enqueued exchange's failure belongs to this call, not the next (the combine is
    // already enqueued, so only the exchange is waited for), unless the group defers it.
    group.end_call()?;
    trace.mark("forward settle");
    Ok(stats)
}

/// This rank's block of the forward exchange, `[k·block + 2, N]`: the `[k, N]` value (lse, and
/// entropy when requested) of each of its tree items (zero rows up to `block` items), then the
/// owning leaf's `(logp, lse)` rows, zero where this rank owns no target.
fn forward_leaves<B: InvariantBackend>(ctx: &Ctx<B>, plan: &Plan) -> Tensor<B, 2> {
    let n = ctx.n;
    // Exactly one leaf of one rank owns a row, so the sum of the picks over ranks is exact in
    // any order.
    let mut picks: Option<FloatTensor<B>> = None;
    let mut leaf = |start: usize, end: usize| {
        let inputs = ctx.leaf_inputs(start, end);
        let leaf_targets = inputs.targets.clone();
        let stats = float_tensor::<B, 2>(B::invariant_linear_logp(inputs, ctx.implementation));
        picks = Some(B::invariant_tp_pick(
            picks.take(),
            float_primitive(stats.clone().slice([0..n, 0..2])),
            leaf_targets,
        ));
        stats.slice([0..n, 1..1 + ctx.tree_rows()]).swap_dims(0, 1)
    };
    let identity = || ctx.tree_identity();
    let mut rows: Vec<Tensor<B, 2>> = plan
        .local_items()
        .iter()
        .map(|&item| plan.eval_item(item, &mut leaf, &identity, &merge_stats::<B>))
        .collect();
    let (block, k) = (plan.block(), ctx.tree_rows());
    if rows.len() < block {
        rows.push(Tensor::zeros(
            [(block - rows.len()) * k, n],
            (&ctx.device, DType::F32),
        ));
    }
    // A rank holds at least one leaf (shards are non-empty).
    rows.push(picks.map_or_else(
        || Tensor::zeros([2, n], (&ctx.device, DType::F32)),
        float_tensor,
    ));
    Tensor::cat(rows, 0)
}

/// The upper levels of the tree over the gathered `[world, k·block + 2, N]` blocks, and the
/// owners' picks: the final `(logp, lse[, entropy])`.
fn forward_combine<B: InvariantBackend>(
    ctx: &Ctx<B>,
    plan: &Plan,
    all: Tensor<B, 3>,
) -> FloatTensor<B> {
    let (n, world, k) = (ctx.n, plan.world(), ctx.tree_rows());
    let picks_at = plan.block() * k;
    let identity = || ctx.tree_identity();
    let item = |rank: usize, index: usize| {
        all.clone()
            .slice([rank..rank + 1, index * k..(index + 1) * k, 0..n])
            .reshape([k, n])
    };
    let tree = plan.eval_global(&item, &identity, &merge_stats::<B>);
    let lse = tree.clone().slice([0..1, 0..n]).reshape([n]);
    let picks_of = |rank: usize| {
        all.clone()
            .slice([rank..rank + 1, picks_at..picks_at + 2, 0..n])
            .reshape([2, n])
    };
    let picks = (1..world).fold(picks_of(0), |acc, rank| acc + picks_of(rank));
    let global_vocab = plan.shards[world - 1].1;
    let stats = B::invariant_tp_finish(
        float_primitive(picks),
        float_primitive(lse),
        ctx.targets.clone(),
        global_vocab,
        ctx.ignore_index,
    );
    if !ctx.head.entropy {
        return stats;
    }
    let mut entropy: Tensor<B, 1> = tree.slice([1..2, 0..n]).reshape([n]);
    if let Some(ignore) = ctx.ignore_index {
        let targets = Tensor::<B, 1, Int>::from_primitive(ctx.targets.clone());
        entropy = entropy.mask_fill(targets.equal_elem(ignore), 0.0);
    }
    float_primitive(Tensor::cat(
        vec![float_tensor::<B, 2>(stats), entropy.reshape([n, 1])],
        1,
    ))
}

/// One rank's gradients before the `dHidden` exchange.
struct LocalGrads<B: InvariantBackend> {
    /// The f32 `dHidden` partial of each of this rank's tree items (when requested).
    hidden: Vec<Option<Tensor<B, 2>>>,
    /// This shard's `dWeight` / `dBias`, one piece per leaf, in row order.
    weights: Vec<Tensor<B, 2>>,
    biases: Vec<Tensor<B, 1>>,
}

/// Backward on one rank from the forward's `stats [N, C]` and the upstream `grad [N, C]`.
/// `dWeight`/`dBias` are this rank's shard; `dHidden` is combined over ranks in tree order
/// (one all-gather, only when requested).
fn backward<B: InvariantBackend, G: Collective<B>>(
    ctx: &Ctx<B>,
    stats: FloatTensor<B>,
    grad: FloatTensor<B>,
    request: GradRequest,
    plan: &Plan,
    group: &G,
) -> Result<LinearLogpGrads<B>, InvariantError> {
    let mut trace = Trace::<B>::start(&ctx.device);
    if ctx.n == 0 {
        // No rows, no exchange (N = 0 on every rank): all gradients are zero.
        let zeros = |t: &Tensor<B, 2>| float_primitive(t.zeros_like());
        return Ok(LinearLogpGrads {
            hidden: request
                .hidden
                .then(|| zeros(&float_tensor(ctx.hidden.clone()))),
            weight: request.weight.then(|| zeros(&ctx.weight)),
            bias: (ctx.bias.as_ref())
                .filter(|_| request.bias)
                .map(|b| float_primitive(b.zeros_like())),
        });
    }
    let local = backward_leaves(ctx, stats, grad, request, plan);
    trace.mark("backward leaves");
    let hidden = if request.hidden {
        let hidden = exchange_d_hidden(ctx, plan, group, local.hidden)?;
        trace.mark("backward exchange");
        Some(hidden)
    } else {
        None
    };
    let cat = |parts: Vec<FloatTensor<B>>| match parts.len() {
        0 => None,
        1 => parts.into_iter().next(),
        _ => Some(float_primitive(Tensor::<B, 2>::cat(
            parts.into_iter().map(float_tensor).collect(),
            0,
        ))),
    };
    let weight = cat(local.weights.into_iter().map(float_primitive).collect());
    let bias = match local.biases.len() {
        0 => None,
        1 => local.biases.into_iter().next().map(float_primitive),
        _ => Some(float_primitive(Tensor::cat(local.biases, 0))),
    };
    trace.mark("backward combine");
    group.end_call()?;
    trace.mark("backward settle");
    Ok(LinearLogpGrads {
        hidden,
        weight,
        bias,
    })
}

/// Every leaf's backward with the global lse. A row whose target lies in another leaf matches
/// no column of this one, so its `dz` there is `(dLse − dLogp)·p` (the contract's `dz` without
/// the one-hot term); ignored rows drop `dLogp` in every leaf.
fn backward_leaves<B: InvariantBackend>(
    ctx: &Ctx<B>,
    stats: FloatTensor<B>,
    grad: FloatTensor<B>,
    request: GradRequest,
    plan: &Plan,
) -> LocalGrads<B> {
    let grad = float_primitive(float_tensor::<B, 2>(grad).cast(DType::F32));
    let leaf_request = GradRequest {
        bias: request.bias && ctx.bias.is_some(),
        ..request
    };
    let (mut weights, mut biases) = (Vec::new(), Vec::new());
    let mut leaf = |start: usize, end: usize| {
        let grads = B::invariant_linear_logp_backward(
            ctx.leaf_inputs(start, end),
            stats.clone(),
            grad.clone(),
            leaf_request,
            ctx.implementation,
        );
        weights.extend(grads.weight.map(float_tensor::<B, 2>));
        biases.extend(grads.bias.map(float_tensor::<B, 1>));
        grads
            .hidden
            .map(|h| float_tensor::<B, 2>(h).cast(DType::F32))
    };
    let identity = || request.hidden.then(|| ctx.f32_zeros_nd());
    let hidden = plan
        .local_items()
        .iter()
        .map(|&item| plan.eval_item(item, &mut leaf, &identity, &add_partials))
        .collect();
    LocalGrads {
        hidden,
        weights,
        biases,
    }
}

fn add_partials<B: InvariantBackend>(
    a: Option<Tensor<B, 2>>,
    b: Option<Tensor<B, 2>>,
) -> Option<Tensor<B, 2>> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a + b),
        _ => None,
    }
}

/// All-gathers every rank's `dHidden` partials and sums them in tree order, in hidden's dtype.
fn exchange_d_hidden<B: InvariantBackend, G: Collective<B>>(
    ctx: &Ctx<B>,
    plan: &Plan,
    group: &G,
    partials: Vec<Option<Tensor<B, 2>>>,
) -> Result<FloatTensor<B>, InvariantError> {
    let (n, d, block, world) = (ctx.n, ctx.d, plan.block(), plan.world());
    let mut rows: Vec<Tensor<B, 2>> = partials.into_iter().flatten().collect();
    rows.resize_with(block, || ctx.f32_zeros_nd());
    // A single item (segment-aligned shards, world ≥ 2): a view, not a 4·N·D-byte copy.
    let mine: Tensor<B, 3> = match <[_; 1]>::try_from(rows) {
        Ok([row]) => row.unsqueeze_dim(0),
        Err(rows) => Tensor::stack(rows, 0),
    };
    let all = group
        .all_gather(mine.reshape([block * n * d]))?
        .reshape([world, block, n, d]);
    let get = |rank: usize, index: usize| {
        all.clone()
            .slice([rank..rank + 1, index..index + 1, 0..n, 0..d])
            .reshape([n, d])
    };
    let identity = || ctx.f32_zeros_nd();
    let sum = plan.eval_global(&get, &identity, &|a, b| a + b);
    let hidden_dtype = float_tensor::<B, 2>(ctx.hidden.clone()).dtype();
    Ok(float_primitive(sum.cast(hidden_dtype)))
}
