//! The public `linear_sample`, its options and output: validation, the registry's choice (that
//! of `linear_logp` on the same problem), the primitive.
use burn::tensor::{DType, Int, Tensor};

use super::{LinearSampleInputs, SampleRule, Sampler};
use crate::backends::generic::{float_primitive, float_tensor};
use crate::ops::linear_logp::api::{check_logits, head_outputs, stats_columns};
use crate::ops::linear_logp::{LinearLogpInputs, LinearLogpOptions};
use crate::registry::check_device;
use crate::{InvariantBackend, InvariantError, validate};

/// The largest `top_k` [`linear_sample`] takes.
pub const TOP_K_MAX: usize = 64;

/// The largest vocabulary [`linear_sample`] takes: tokens travel as exact f32 integers.
pub const VOCAB_MAX: usize = 1 << 24;

/// Options of [`linear_sample`].
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOptions {
    /// The run's seed: with a row's key it fixes the row's noise, so a rerun draws the same
    /// tokens.
    pub seed: u64,
    /// Softmax temperature `T` as in [`LinearLogpOptions::temperature`]: the draw is from
    /// `softmax(z)` with `z = (hidden · weightᵀ + bias) · f32(1/T)`, and `logp`, `lse`,
    /// `entropy` are those of that `z`.
    pub temperature: f64,
    /// Take `argmax z` instead of drawing (ties to the smaller index); `logp` is still that of
    /// the tempered softmax.
    pub greedy: bool,
    /// Draw among the `k` largest logits only (ties to the smaller index), `1 ≤ k ≤`
    /// [`TOP_K_MAX`]; `logp` and `entropy` stay those of the full softmax (the trainer's).
    pub top_k: Option<usize>,
    /// Nucleus sampling: not supported (a typed error). Its cut depends on the sorted mass of
    /// the whole row, which the one pass over the vocabulary does not have.
    pub top_p: Option<f64>,
    /// Min-p sampling: not supported (a typed error). Its cut depends on the row's maximum,
    /// known only at the end of the pass.
    pub min_p: Option<f64>,
    /// Whether the output carries the per-row entropy of the tempered softmax.
    pub entropy: bool,
}

impl Default for SampleOptions {
    fn default() -> Self {
        Self {
            seed: 0,
            temperature: 1.0,
            greedy: false,
            top_k: None,
            top_p: None,
            min_p: None,
            entropy: false,
        }
    }
}

impl SampleOptions {
    /// Sets [`Self::seed`].
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sets [`Self::temperature`] (checked when the options are used).
    pub fn with_temperature(mut self, temperature: f64) -> Self {
        self.temperature = temperature;
        self
    }

    /// Sets [`Self::greedy`].
    pub fn with_greedy(mut self, greedy: bool) -> Self {
        self.greedy = greedy;
        self
    }

    /// Sets [`Self::top_k`] (checked when the options are used).
    pub fn with_top_k(mut self, k: usize) -> Self {
        self.top_k = Some(k);
        self
    }

    /// Sets [`Self::entropy`].
    pub fn with_entropy(mut self, entropy: bool) -> Self {
        self.entropy = entropy;
        self
    }

    /// The `linear_logp_full` options whose `logp`, `lse` and `entropy` these equal.
    pub fn logp_options(&self) -> LinearLogpOptions {
        LinearLogpOptions::default()
            .with_temperature(self.temperature)
            .with_entropy(self.entropy)
    }

    pub(crate) fn sampler(&self) -> Result<Sampler, InvariantError> {
        let unsupported = |arg, what: &str| InvariantError::InvalidArgument {
            arg,
            reason: format!(
                "{what} sampling is not supported: its cut needs the whole row before any \
                 token can be ruled out, which the one pass over the vocabulary does not have"
            ),
        };
        if self.top_p.is_some() {
            return Err(unsupported("top_p", "nucleus (top-p)"));
        }
        if self.min_p.is_some() {
            return Err(unsupported("min_p", "min-p"));
        }
        let rule = match (self.greedy, self.top_k) {
            (_, Some(k)) if !(1..=TOP_K_MAX).contains(&k) => {
                return Err(InvariantError::InvalidArgument {
                    arg: "top_k",
                    reason: format!("must be in 1..={TOP_K_MAX}, got {k}"),
                });
            }
            (true, _) => SampleRule::Greedy,
            (false, Some(k)) => SampleRule::TopK(k),
            (false, None) => SampleRule::Gumbel,
        };
        Ok(Sampler {
            seed: self.seed,
            rule,
        })
    }
}

/// What [`linear_sample`] returns.
#[derive(Debug, Clone)]
pub struct LinearSampleOutput<B: burn::tensor::backend::Backend> {
    /// `[N]` the sampled tokens; −1 for a row whose tempered logits are all −∞ or NaN.
    pub tokens: Tensor<B, 1, Int>,
    /// `[N]` f32 `log softmax(z)[token]`: bitwise what [`crate::linear_logp_full`] returns for
    /// this row and token with [`SampleOptions::logp_options`] (NaN for a token of −1).
    pub logp: Tensor<B, 1>,
    /// `[N]` f32 `logsumexp z`, as [`crate::linear_logp_full`] gives it.
    pub lse: Tensor<B, 1>,
    /// `[N]` f32 entropy of `softmax(z)`, as [`crate::linear_logp_full`] gives it; `Some` iff
    /// [`SampleOptions::entropy`].
    pub entropy: Option<Tensor<B, 1>>,
}

/// Draws one token per row of `hidden [N, D]` from the tempered softmax of
/// `hidden · weightᵀ + bias` (`weight [V, D]`, `bias [V]`) in one pass over the vocabulary,
/// never materializing `[N, V]`, by Gumbel-max with noise from `(options.seed, keys[i], j)`.
///
/// A row's token depends only on its hidden state, the weights, its key and the seed: alone, in
/// any batch and on a rerun it is the same. Its `logp`, `lse` and `entropy` are bitwise those
/// [`crate::linear_logp_full`] returns for that row and token with
/// [`SampleOptions::logp_options`], so the rollout's log-prob is the trainer's. `keys [N]` are
/// any integers (taken modulo 2³²), e.g. `sequence · max_len + position`. The outputs are not
/// differentiable.
///
/// ```
/// # use burn::tensor::{Distribution, Int, Tensor};
/// # use burn_invariant::SampleOptions;
/// # type B = burn::backend::NdArray<f32>;
/// # let device = Default::default();
/// # let hidden = Tensor::<B, 2>::random([3, 16], Distribution::Uniform(-1.0, 1.0), &device);
/// # let weight = Tensor::<B, 2>::random([40, 16], Distribution::Uniform(-1.0, 1.0), &device);
/// let keys = Tensor::<B, 1, Int>::from_ints([10, 11, 12], &device);
/// let opts = SampleOptions::default().with_seed(7).with_temperature(0.8).with_top_k(20);
/// let out = burn_invariant::linear_sample(hidden, weight, keys, None, &opts)?;
/// assert_eq!(out.tokens.dims(), [3]);
/// # Ok::<(), burn_invariant::InvariantError>(())
/// ```
pub fn linear_sample<B: InvariantBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    keys: Tensor<B, 1, Int>,
    bias: Option<Tensor<B, 1>>,
    options: &SampleOptions,
) -> Result<LinearSampleOutput<B>, InvariantError> {
    let head = options.logp_options().head(options.entropy)?;
    let sampler = options.sampler()?;
    let implementation = check_logits(&hidden, &weight, ("keys", &keys), bias.as_ref())?;
    let [n, _] = hidden.dims();
    check_vocab(&weight)?;
    validate::index_limit("keys", &[n, head.columns() + 1])?;
    let device = hidden.device();
    if n == 0 {
        let empty = || Tensor::<B, 1>::empty([0], (&device, DType::F32));
        return Ok(LinearSampleOutput {
            tokens: Tensor::empty([0], &device),
            logp: empty(),
            lse: empty(),
            entropy: head.entropy.then(empty),
        });
    }
    let inputs = LinearSampleInputs {
        hidden: float_primitive(hidden),
        weight: float_primitive(weight),
        bias: bias.map(float_primitive),
        keys: keys.into_primitive(),
        head,
        sampler,
    };
    let out: Tensor<B, 2> = float_tensor(B::invariant_linear_sample(inputs, implementation));
    check_device::<B>(&device)?;
    // `[N, C + 1]`: the head's columns, then the token's.
    let mut columns = stats_columns(out);
    let tokens = columns.pop().expect("the token column").int();
    let stats = head_outputs(columns, head);
    Ok(LinearSampleOutput {
        tokens,
        logp: stats.logp,
        lse: stats.lse,
        entropy: stats.entropy,
    })
}

/// `[N, 2k]` f32: each row's `k` largest tempered logits (temperature of `options`), best first
/// (ties to the smaller column), then their columns; `(−∞, −1)` past the ranking logits. The
/// backend's [`super::LinearSampleOps::invariant_linear_top_k`] after the checks of
/// [`linear_sample`] (`keys [N]` checked, not read); tensor parallelism merges the shards' lists
/// with it.
pub(crate) fn linear_top_k<B: InvariantBackend>(
    hidden: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    keys: &Tensor<B, 1, Int>,
    bias: Option<&Tensor<B, 1>>,
    k: usize,
    options: &SampleOptions,
) -> Result<Tensor<B, 2>, InvariantError> {
    let head = options.logp_options().head(false)?;
    let [n, _] = hidden.dims();
    let device = hidden.device();
    let implementation = check_logits(hidden, weight, ("keys", keys), bias)?;
    check_vocab(weight)?;
    if !(1..=TOP_K_MAX).contains(&k) {
        return Err(InvariantError::InvalidArgument {
            arg: "top_k",
            reason: format!("must be in 1..={TOP_K_MAX}, got {k}"),
        });
    }
    validate::index_limit("hidden", &[n, 2 * k])?;
    if n == 0 {
        return Ok(Tensor::empty([0, 2 * k], (&device, DType::F32)));
    }
    let inputs = LinearLogpInputs {
        hidden: float_primitive(hidden.clone()),
        weight: float_primitive(weight.clone()),
        bias: bias.cloned().map(float_primitive),
        targets: keys.clone().into_primitive(),
        ignore_index: None,
        head,
    };
    let out = float_tensor(B::invariant_linear_top_k(inputs, k, implementation));
    check_device::<B>(&device)?;
    Ok(out)
}

/// `V ≤ VOCAB_MAX` (`TooLarge`).
fn check_vocab<B: InvariantBackend>(weight: &Tensor<B, 2>) -> Result<(), InvariantError> {
    let v = weight.dims()[0];
    if v > VOCAB_MAX {
        return Err(InvariantError::TooLarge {
            arg: "weight",
            what: "vocabulary size V",
            got: v as u64,
            limit: VOCAB_MAX as u64,
        });
    }
    Ok(())
}
