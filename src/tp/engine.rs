//! The segment algorithm on one backend (never `Autodiff`: [`super::autodiff`] wraps it).
//!
//! Every leaf (a segment, or the piece of one that a rank holds) is one call of the
//! single-rank primitives on that slice of the weight, with the targets remapped: rows whose
//! target lies in the leaf get its local index, every other row the ignore sentinel. A leaf's
//! computation therefore does not depend on which rank runs it.
use burn::tensor::{Bool, DType, Int, Tensor, TensorPrimitive, ops::FloatTensor};

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

/// The ignore index of the leaf calls; remapped targets of owned rows are in `[0, leaf)`.
const SENTINEL: i64 = -1;

fn wrap<B: InvariantBackend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn raw<B: InvariantBackend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// `lse(a, b) = max + ln(1 + exp(−|a − b|))`, exact for an empty side (−∞) and for equal
/// infinities; NaN propagates.
fn merge_lse<B: InvariantBackend>(a: Tensor<B, 1>, b: Tensor<B, 1>) -> Tensor<B, 1> {
    let max = a.clone().max_pair(b.clone());
    let same = a.clone().equal(b.clone());
    let gap = (a - b).abs().neg().mask_fill(same, 0.0);
    max + gap.exp().log1p()
}

/// One rank's inputs, as tensors, with the per-row masks every leaf needs.
struct Ctx<B: InvariantBackend> {
    hidden: FloatTensor<B>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    targets: Tensor<B, 1, Int>,
    /// `target == ignore_index`.
    ignored: Option<Tensor<B, 1, Bool>>,
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
        let device = hidden.device();
        let targets: Tensor<B, 1, Int> = Tensor::from_primitive(inputs.targets);
        let ignored = inputs
            .ignore_index
            .map(|index| targets.clone().equal_elem(index));
        Self {
            hidden: inputs.hidden,
            weight: wrap(inputs.weight),
            bias: inputs.bias.map(wrap),
            targets,
            ignored,
            offset: plan.shard().0,
            n,
            d,
            device,
            implementation,
        }
    }

    fn f32_full(&self, value: f32) -> Tensor<B, 1> {
        Tensor::full([self.n], value, (&self.device, DType::F32))
    }

    /// Rows whose (non-ignored) target is in `[start, end)`.
    fn owned(&self, start: usize, end: usize) -> Tensor<B, 1, Bool> {
        let t = &self.targets;
        let owned = t
            .clone()
            .greater_equal_elem(start as i64)
            .bool_and(t.clone().lower_elem(end as i64));
        match &self.ignored {
            Some(ignored) => owned.bool_and(ignored.clone().bool_not()),
            None => owned,
        }
    }

    /// Rows that are neither ignored nor in `[0, global_vocab)` (possible only with
    /// `skip_target_check`): they give NaN, like the single-rank API.
    fn unowned(&self, global_vocab: usize) -> Tensor<B, 1, Bool> {
        let outside = self.owned(0, global_vocab).bool_not();
        match &self.ignored {
            Some(ignored) => outside.bool_and(ignored.clone().bool_not()),
            None => outside,
        }
    }

    /// The leaf `[start, end)` (global rows) as single-rank primitive inputs.
    fn leaf_inputs(&self, start: usize, end: usize) -> (LinearLogpInputs<B>, Tensor<B, 1, Bool>) {
        let (a, b) = (start - self.offset, end - self.offset);
        let owned = self.owned(start, end);
        let targets = self
            .targets
            .clone()
            .sub_scalar(start as i64)
            .mask_fill(owned.clone().bool_not(), SENTINEL);
        let inputs = LinearLogpInputs {
            hidden: self.hidden.clone(),
            weight: raw(self.weight.clone().slice([a..b, 0..self.d])),
            bias: self.bias.clone().map(|bias| raw(bias.slice(a..b))),
            targets: targets.into_primitive(),
            ignore_index: Some(SENTINEL),
        };
        (inputs, owned)
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
    // The owning leaf's (logp, lse), zero elsewhere: exactly one leaf of one rank contributes
    // per row, so these sums are exact in any order (x + 0 = x).
    let mut pick_logp: Option<Tensor<B, 1>> = None;
    let mut pick_lse: Option<Tensor<B, 1>> = None;
    let accumulate = |sum: &mut Option<Tensor<B, 1>>, term: Tensor<B, 1>| {
        *sum = Some(match sum.take() {
            Some(sum) => sum + term,
            None => term,
        });
    };
    let mut leaf = |start: usize, end: usize| {
        let (inputs, owned) = ctx.leaf_inputs(start, end);
        let stats: Tensor<B, 2> = wrap(B::invariant_linear_logp(inputs, ctx.implementation));
        let logp = stats.clone().slice([0..n, 0..1]).reshape([n]);
        let lse = stats.slice([0..n, 1..2]).reshape([n]);
        accumulate(&mut pick_logp, logp);
        accumulate(&mut pick_lse, lse.clone().mask_fill(owned.bool_not(), 0.0));
        lse
    };
    let identity = || ctx.f32_full(f32::NEG_INFINITY);
    let mut rows: Vec<Tensor<B, 1>> = plan
        .local_items()
        .iter()
        .map(|&item| plan.eval_item(item, &mut leaf, &identity, &merge_lse::<B>))
        .collect();
    let block = plan.block();
    rows.resize_with(block, || ctx.f32_full(0.0));
    // A rank holds at least one leaf (shards are non-empty).
    rows.push(pick_logp.unwrap_or_else(|| ctx.f32_full(0.0)));
    rows.push(pick_lse.unwrap_or_else(|| ctx.f32_full(0.0)));
    let world = plan.world();
    let mine: Tensor<B, 2> = Tensor::stack(rows, 0);
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
    let sum_over_ranks =
        |index: usize| (1..world).fold(row(0, index), |acc, rank| acc + row(rank, index));
    let (pick_logp, pick_lse) = (sum_over_ranks(block), sum_over_ranks(block + 1));
    let mut logp = pick_logp + (pick_lse - lse.clone());
    if let Some(ignored) = &ctx.ignored {
        logp = logp.mask_fill(ignored.clone(), 0.0);
    }
    if !plan.targets_checked {
        let global_vocab = plan.shards[world - 1].1;
        logp = logp.mask_fill(ctx.unowned(global_vocab), f32::NAN);
    }
    let stats = Tensor::stack::<2>(vec![logp, lse], 1);
    trace.mark("forward combine");
    Ok(raw(stats))
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
    let stats: Tensor<B, 2> = wrap(stats);
    let grad: Tensor<B, 2> = wrap::<B, 2>(grad).cast(DType::F32);
    let lse = stats.slice([0..n, 1..2]).reshape([n]);
    // Only the lse column of the leaf stats is read: the global lse.
    let leaf_stats = Tensor::stack::<2>(vec![lse.clone(), lse], 1);
    let mut g_logp = grad.clone().slice([0..n, 0..1]).reshape([n]);
    if let Some(ignored) = &ctx.ignored {
        g_logp = g_logp.mask_fill(ignored.clone(), 0.0);
    }
    let g_lse = grad.slice([0..n, 1..2]).reshape([n]);
    // A row whose target lies elsewhere sees dz = (dLse − dLogp)·p: it is ignored in this leaf
    // and its lse gradient is dLse − dLogp (SPEC §4's dz with the one-hot term absent).
    let g_other = g_lse.clone() - g_logp.clone();
    let leaf_request = GradRequest {
        bias: request.bias && has_bias,
        ..request
    };
    let mut weights = Vec::new();
    let mut biases = Vec::new();
    let mut leaf = |start: usize, end: usize| {
        let (inputs, owned) = ctx.leaf_inputs(start, end);
        let leaf_grad = Tensor::stack::<2>(
            vec![
                g_logp.clone(),
                g_other.clone().mask_where(owned, g_lse.clone()),
            ],
            1,
        );
        let grads = B::invariant_linear_logp_backward(
            inputs,
            raw(leaf_stats.clone()),
            raw(leaf_grad),
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
