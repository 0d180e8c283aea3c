//! Tensor-parallel (vocabulary-sharded) `linear_logp` (docs/CONTRACT.md, *Tensor parallelism*).
//!
//! Each rank holds `weight[start..end, :]` (and that slice of the bias), the full `hidden`,
//! the global `targets` and a [`Collective`] handle; every rank returns the same `logp` and
//! `lse` for all N rows.
//!
//! ```
//! # use burn::tensor::{Distribution, Int, Tensor};
//! # use burn_invariant::{LinearLogpOptions, tp::{self, InProcessGroup, VocabShard}};
//! # type B = burn::backend::NdArray<f32>;
//! # let device = Default::default();
//! # let (world, r, v_global, options) = (1, 0, 40, LinearLogpOptions::default());
//! # let hidden = Tensor::<B, 2>::random([3, 16], Distribution::Uniform(-1.0, 1.0), &device);
//! # let weight_shard = Tensor::<B, 2>::random([40, 16], Distribution::Uniform(-1.0, 1.0), &device);
//! # let targets = Tensor::<B, 1, Int>::from_ints([0, 7, 39], &device);
//! # let bias_shard = None;
//! let groups = InProcessGroup::new(world);           // or an NCCL group, one per GPU
//! // on rank r, in its own thread:
//! let shard = VocabShard::split(r, world, v_global);
//! let (logp, lse) = tp::linear_logp_with_lse(hidden, weight_shard, targets, bias_shard,
//!                                           &shard, &groups[r], &options)?;
//! # Ok::<(), burn_invariant::InvariantError>(())
//! ```
//!
//! # Algorithm and the TP-size invariance rule
//! - The vocabulary is cut into [`SEGMENTS`] = 8 segments by [`segment_bounds`], a function of
//!   `V_global` only. A *leaf* is a segment, or the piece of a segment a rank holds when a
//!   shard boundary cuts it. Each leaf is one call of the single-rank primitive on that slice
//!   of the weight (a target in another leaf matches no column of this one), so it walks its
//!   tiles in ascending order and its result does not depend on the rank that runs it.
//! - Leaf `lse`s are combined in one fixed binary tree over the segments (halving:
//!   `[0,8) = [0,4) ⊕ [4,8)`, …) with `a ⊕ b = max + ln(1 + exp(−|a − b|))`. A rank evaluates
//!   the largest tree nodes inside its shard; one all-gather exchanges them, and every rank
//!   evaluates the upper levels of the same tree. The target's `logp` comes from the leaf
//!   that owns it: `logp = logp_leaf + (lse_leaf − lse)`.
//! - The per-row steps (target remap, `⊕`, owner pick, final `logp`) are backend primitives
//!   (`InvariantBackend::invariant_tp_*`): one CubeCL kernel each on `CubeBackend`, a few Burn
//!   ops elsewhere, so a rank issues a handful of launches per leaf, not dozens of tiny ops.
//! - Backward: each leaf recomputes its logits with the **global** `lse`; rows whose target
//!   lies elsewhere get `dz = (dLse − dLogp)·p`. `dHidden` leaf partials (f32) are added in the
//!   same tree, exchanged with one all-gather; `dWeight`/`dBias` stay local.
//! - With shards on segment boundaries and world sizes 1, 2, 4 or 8 (each rank holding
//!   `8 / world` consecutive segments, [`VocabShard::split`]), every rank's contribution is a
//!   node of the one tree, so `logp`, `lse` and `dHidden` are **bitwise identical across these
//!   world sizes**. Other shardings (uneven, cut segments, world 3) are correct to rounding
//!   but not bitwise comparable with other world sizes. `tp::linear_logp` need not match the
//!   single-rank [`crate::linear_logp`] bitwise (its order differs), only within rounding.
//! - `dHidden` leaf partials come out of the primitive in `hidden`'s dtype before the f32 tree
//!   sum: for bf16/f16 hidden that is one rounding per leaf.
//!
//! # Validation is collective
//! Before any compute, every rank checks its own inputs (the checks of [`crate::linear_logp`], plus its shard against
//! `weight`), then the ranks exchange one small host table and every rank derives the same
//! verdict: shards contiguous in rank order and covering `[0, V_global)`, the same N, D,
//! `V_global`, dtype, bias presence, options, implementation and `hidden.requires_grad` on
//! every rank, identical targets (a hash, from the same single host read as the range check;
//! skipped with `skip_target_check`), every target in `[0, V_global)` or ignored (so owned by
//! exactly one rank). Any failure is the **same** [`InvariantError`] on every rank
//! ([`InvariantError::RankFailed`] carries a rank's own error as text). `hidden` itself is
//! assumed equal on every rank (not checked: that would need a host read of `[N, D]`).
//!
//! A rank whose tensors are not on its group's device ([`Collective::device`], e.g. an
//! `NcclGroup` on another GPU) fails validation like any local check, on every rank.
//!
//! # Faults
//! Every wait is bounded by the group's timeout. A failed exchange fails the call that made
//! it, on every rank: each call ends with [`Collective::end_call`] (by default
//! [`Collective::settle`]), which waits for an exchange that was only enqueued (NCCL) and
//! returns its error. `NcclGroup::with_deferred_failures(true)` skips that wait: the failure
//! (its result NaN, never stale) is then reported by the group's next call or `settle`.
//!
//! # Autodiff
//! Works for `B` and `Autodiff<B>`. The backward exchanges `dHidden` through the group, so
//! every rank must run the backward of the call (validation makes sure that all or none of
//! the ranks need `dHidden`). A collective failure inside the backward cannot be returned:
//! the requested gradients come back NaN (their shapes, dtypes and device), the error is
//! logged with `log::error!` and handed to [`Collective::fail`], so every rank's next call on
//! the group returns it. Never a panic.
mod check;
mod collective;
mod engine;
mod plan;
mod sample;
mod trace;

use burn::tensor::{Int, Tensor};

#[cfg(feature = "cuda")]
pub use crate::backends::cuda::CudaBackend;
pub use collective::{Collective, DEFAULT_TIMEOUT, InProcessGroup, LONGEST_TIMEOUT};
#[cfg(feature = "cuda")]
pub use collective::{NCCL_DEFAULT_TIMEOUT, NcclGroup, NcclId};
pub use plan::{Plan, SEGMENT_ALIGN, SEGMENTS, segment_bounds};
pub use sample::linear_sample;

use crate::backend::LinearLogpInputs;
use crate::backends::generic::{float_primitive, float_tensor};
use crate::ops::linear_logp::api::split_stats;
use crate::{InvariantBackend, InvariantError, LinearLogpOptions, LinearLogpOutput};

/// The vocabulary rows `[start, end)` of `[0, global_vocab)` that one rank holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VocabShard {
    /// First row (inclusive).
    pub start: usize,
    /// Last row (exclusive).
    pub end: usize,
    /// `V_global`.
    pub global_vocab: usize,
}

impl VocabShard {
    /// `[start, end)` of `[0, global_vocab)`.
    pub fn new(start: usize, end: usize, global_vocab: usize) -> Self {
        Self {
            start,
            end,
            global_vocab,
        }
    }

    /// Rows in the shard.
    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start)
    }

    /// Whether the shard holds no row (invalid for `tp::linear_logp`).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rank `rank`'s shard of `world`: `8 / world` consecutive segments when `world` divides
    /// [`SEGMENTS`] and no shard would be empty (the TP-size-invariant layout), otherwise rows
    /// split as evenly as possible (`⌊r·V/world⌋`). A `rank ≥ world` gets the empty shard at
    /// `V`, which the tensor-parallel functions refuse.
    pub fn split(rank: usize, world: usize, global_vocab: usize) -> Self {
        if rank >= world {
            return Self::new(global_vocab, global_vocab, global_vocab);
        }
        let bounds = segment_bounds(global_vocab);
        if SEGMENTS.is_multiple_of(world) {
            let per = SEGMENTS / world;
            let aligned = |r: usize| (bounds[r * per], bounds[(r + 1) * per]);
            if (0..world).all(|r| aligned(r).0 < aligned(r).1) {
                let (start, end) = aligned(rank);
                return Self::new(start, end, global_vocab);
            }
        }
        let at = |r: usize| (r as u128 * global_vocab as u128 / world as u128) as usize;
        Self::new(at(rank), at(rank + 1), global_vocab)
    }

    /// The rows as a range.
    pub fn range(&self) -> core::ops::Range<usize> {
        self.start..self.end
    }
}

/// Tensor-parallel [`crate::linear_logp`]: `log_softmax(hidden · Wᵀ + b)[i, targets[i]]` over
/// the global vocabulary, f32 `[N]`, the same on every rank. `weight [end − start, D]` and
/// `bias [end − start]` are this rank's shard; `hidden [N, D]` and `targets [N]` are global.
/// Differentiable w.r.t. hidden (combined over ranks), weight and bias (this shard).
pub fn linear_logp<B, G>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    bias: Option<Tensor<B, 1>>,
    shard: &VocabShard,
    group: &G,
    options: &LinearLogpOptions,
) -> Result<Tensor<B, 1>, InvariantError>
where
    B: InvariantBackend,
    G: Collective<B> + Clone + 'static,
{
    linear_logp_with_lse(hidden, weight, targets, bias, shard, group, options).map(|(l, _)| l)
}

/// [`linear_logp`] that also returns the global `lse[i] = logsumexp_j z[i, j]`; both f32 `[N]`,
/// both differentiable.
pub fn linear_logp_with_lse<B, G>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    bias: Option<Tensor<B, 1>>,
    shard: &VocabShard,
    group: &G,
    options: &LinearLogpOptions,
) -> Result<(Tensor<B, 1>, Tensor<B, 1>), InvariantError>
where
    B: InvariantBackend,
    G: Collective<B> + Clone + 'static,
{
    let out = sharded(hidden, weight, targets, bias, shard, group, options, false)?;
    Ok((out.logp, out.lse))
}

/// Tensor-parallel [`crate::linear_logp_full`]: `logp`, the global `lse` and, with
/// [`LinearLogpOptions::entropy`], the entropy of the global tempered softmax, each f32 `[N]`,
/// the same on every rank and differentiable. Leaf entropies merge in the fixed tree with the
/// leaf `lse`s, so shards on segment boundaries give the same bits for worlds 1, 2, 4 and 8.
pub fn linear_logp_full<B, G>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    bias: Option<Tensor<B, 1>>,
    shard: &VocabShard,
    group: &G,
    options: &LinearLogpOptions,
) -> Result<LinearLogpOutput<B>, InvariantError>
where
    B: InvariantBackend,
    G: Collective<B> + Clone + 'static,
{
    sharded(
        hidden,
        weight,
        targets,
        bias,
        shard,
        group,
        options,
        options.entropy,
    )
}

#[allow(clippy::too_many_arguments)] // the public arguments, and whether entropy is computed
fn sharded<B, G>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    bias: Option<Tensor<B, 1>>,
    shard: &VocabShard,
    group: &G,
    options: &LinearLogpOptions,
    entropy: bool,
) -> Result<LinearLogpOutput<B>, InvariantError>
where
    B: InvariantBackend,
    G: Collective<B> + Clone + 'static,
{
    let device = hidden.device();
    let mut trace = trace::Trace::<B>::start(&device);
    let (plan, implementation) = check::collective(
        &check::RankInputs {
            hidden: &hidden,
            weight: &weight,
            targets: &targets,
            bias: bias.as_ref(),
            shard,
            options,
            entropy,
            extra: None,
        },
        group,
    )?;
    // Every rank has the same options (checked): this fails on all of them or none.
    let head = options.head(entropy)?;
    trace.mark("validation: verdict");
    let inputs = LinearLogpInputs {
        hidden: float_primitive(hidden),
        weight: float_primitive(weight),
        bias: bias.map(float_primitive),
        targets: targets.into_primitive(),
        ignore_index: options.ignore_index,
        head,
    };
    let engine = engine::Engine::new(plan, implementation);
    let stats = float_tensor(B::invariant_collective_linear_logp(inputs, &engine, group)?);
    Ok(split_stats(stats, head))
}
