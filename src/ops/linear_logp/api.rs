//! The public `linear_logp`, `linear_logp_with_lse` and `linear_logp_full` (docs/CONTRACT.md,
//! *Public API*), their options and output: validation, the registry's choice, the primitive.
use burn::tensor::{Int, Tensor};

use super::{LinearLogpInputs, LogpHead};
use crate::backends::generic::{float_primitive, float_tensor};
use crate::registry::{Implementation, Problem, check_device, implementation_for_problem};
use crate::{InvariantBackend, InvariantError, validate};

/// Options of [`linear_logp`], [`linear_logp_with_lse`] and [`linear_logp_full`].
#[derive(Debug, Clone, PartialEq)]
pub struct LinearLogpOptions {
    /// Rows whose target equals this give `logp = 0` and `entropy = 0`, and no gradient from
    /// either; their `lse` is computed (and differentiated) normally.
    pub ignore_index: Option<i64>,
    /// Skip the host read that checks every target is in `[0, V)`. For callers that
    /// validated upstream: a bad target then gives NaN instead of an error, never an
    /// out-of-bounds access.
    pub skip_target_check: bool,
    /// Softmax temperature `T`: the logits are `(hidden · weightᵀ + bias) / T`, computed as a
    /// product with `1/T` rounded to f32 once. Finite and `> 0` (and `1/T` a normal f32);
    /// 1.0 (the default) leaves the logits bitwise unchanged.
    pub temperature: f64,
    /// Whether [`linear_logp_full`] returns the per-row entropy of the tempered softmax. The
    /// other functions ignore it.
    pub entropy: bool,
}

impl Default for LinearLogpOptions {
    fn default() -> Self {
        Self {
            ignore_index: None,
            skip_target_check: false,
            temperature: 1.0,
            entropy: false,
        }
    }
}

impl LinearLogpOptions {
    /// Sets [`Self::ignore_index`].
    pub fn with_ignore_index(mut self, ignore_index: i64) -> Self {
        self.ignore_index = Some(ignore_index);
        self
    }

    /// Sets [`Self::skip_target_check`].
    pub fn with_skip_target_check(mut self, skip: bool) -> Self {
        self.skip_target_check = skip;
        self
    }

    /// Sets [`Self::temperature`] (checked when the options are used).
    pub fn with_temperature(mut self, temperature: f64) -> Self {
        self.temperature = temperature;
        self
    }

    /// Sets [`Self::entropy`].
    pub fn with_entropy(mut self, entropy: bool) -> Self {
        self.entropy = entropy;
        self
    }

    /// The primitives' head for these options, `entropy` as given; errors name `temperature`.
    pub(crate) fn head(&self, entropy: bool) -> Result<LogpHead, InvariantError> {
        let t = self.temperature;
        let inv = (1.0 / t) as f32;
        if !(t.is_finite() && t > 0.0 && inv.is_normal()) {
            return Err(InvariantError::InvalidArgument {
                arg: "temperature",
                reason: format!(
                    "must be finite and > 0 with 1/temperature a normal f32 (about 3e-39 < \
                     temperature < 8.5e37), got {t}"
                ),
            });
        }
        Ok(LogpHead {
            inv_temperature: inv,
            entropy,
        })
    }
}

/// What [`linear_logp_full`] returns, every tensor f32 `[N]` whatever the backend's float type.
#[derive(Debug, Clone)]
pub struct LinearLogpOutput<B: burn::tensor::backend::Backend> {
    /// `z[i, targets[i]] − lse[i]`; 0 for ignored rows.
    pub logp: Tensor<B, 1>,
    /// `logsumexp_j z[i, j]`.
    pub lse: Tensor<B, 1>,
    /// `lse[i] − Σ_j softmax(z[i])_j · z[i, j]` (nats), `Some` iff
    /// [`LinearLogpOptions::entropy`]; 0 for ignored rows.
    pub entropy: Option<Tensor<B, 1>>,
}

/// `log_softmax(z)[i, targets[i]]` with `z = (hidden · weightᵀ + bias) / T` as f32 `[N]`, without
/// ever materializing the `[N, V]` logits (`T` is [`LinearLogpOptions::temperature`], 1 by
/// default). `hidden [N, D]`, `weight [V, D]` (LM-head layout),
/// `bias [V]`. Differentiable w.r.t. hidden, weight and bias; batch-invariant per row.
pub fn linear_logp<B: InvariantBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    bias: Option<Tensor<B, 1>>,
    options: &LinearLogpOptions,
) -> Result<Tensor<B, 1>, InvariantError> {
    linear_logp_with_lse(hidden, weight, targets, bias, options).map(|(logp, _)| logp)
}

/// [`linear_logp`] that also returns `lse[i] = logsumexp_j z[i, j]` (for z-loss,
/// diagnostics); both are f32 `[N]` and both are differentiable.
pub fn linear_logp_with_lse<B: InvariantBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    bias: Option<Tensor<B, 1>>,
    options: &LinearLogpOptions,
) -> Result<(Tensor<B, 1>, Tensor<B, 1>), InvariantError> {
    let head = options.head(false)?;
    let out = linear_logp_head(hidden, weight, targets, bias, options, head)?;
    Ok((out.logp, out.lse))
}

/// The RL head: [`linear_logp`] at [`LinearLogpOptions::temperature`] with `lse` and, when
/// [`LinearLogpOptions::entropy`] is set, the per-row entropy of the tempered softmax, all from
/// one pass over the vocabulary. Every output is f32 `[N]`, differentiable (into hidden, weight
/// and bias) and batch-invariant per row; `logp` and `lse` are those of [`linear_logp_with_lse`]
/// with the same options, bitwise.
///
/// ```
/// # use burn::tensor::{Distribution, Int, Tensor};
/// # use burn_invariant::LinearLogpOptions;
/// # type B = burn::backend::NdArray<f32>;
/// # let device = Default::default();
/// # let hidden = Tensor::<B, 2>::random([3, 16], Distribution::Uniform(-1.0, 1.0), &device);
/// # let weight = Tensor::<B, 2>::random([40, 16], Distribution::Uniform(-1.0, 1.0), &device);
/// # let targets = Tensor::<B, 1, Int>::from_ints([0, 7, 39], &device);
/// let opts = LinearLogpOptions::default().with_temperature(0.7).with_entropy(true);
/// let out = burn_invariant::linear_logp_full(hidden, weight, targets, None, &opts)?;
/// let entropy = out.entropy.expect("requested");
/// # Ok::<(), burn_invariant::InvariantError>(())
/// ```
pub fn linear_logp_full<B: InvariantBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    bias: Option<Tensor<B, 1>>,
    options: &LinearLogpOptions,
) -> Result<LinearLogpOutput<B>, InvariantError> {
    let head = options.head(options.entropy)?;
    linear_logp_head(hidden, weight, targets, bias, options, head)
}

fn linear_logp_head<B: InvariantBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    bias: Option<Tensor<B, 1>>,
    options: &LinearLogpOptions,
    head: LogpHead,
) -> Result<LinearLogpOutput<B>, InvariantError> {
    let implementation = check_linear_logp(&hidden, &weight, &targets, bias.as_ref(), options)?;
    let n = hidden.dims()[0];
    if n == 0 {
        // Nothing to compute (and no zero-sized kernel launches, which CUDA rejects).
        let device = hidden.device();
        let empty = || Tensor::<B, 1>::empty([0], (&device, burn::tensor::DType::F32));
        return Ok(LinearLogpOutput {
            logp: empty(),
            lse: empty(),
            entropy: head.entropy.then(empty),
        });
    }
    let device = hidden.device();
    let inputs = LinearLogpInputs {
        hidden: float_primitive(hidden),
        weight: float_primitive(weight),
        bias: bias.map(float_primitive),
        targets: targets.into_primitive(),
        ignore_index: options.ignore_index,
        head,
    };
    let stats = float_tensor(B::invariant_linear_logp(inputs, implementation));
    check_device::<B>(&device)?;
    Ok(split_stats(stats, head))
}

/// The columns of `[N, C]` statistics as the public outputs.
pub(crate) fn split_stats<B: InvariantBackend>(
    stats: Tensor<B, 2>,
    head: LogpHead,
) -> LinearLogpOutput<B> {
    head_outputs(stats_columns(stats), head)
}

/// The public outputs from the statistics' columns `(logp, lse[, entropy])`.
pub(crate) fn head_outputs<B: InvariantBackend>(
    columns: Vec<Tensor<B, 1>>,
    head: LogpHead,
) -> LinearLogpOutput<B> {
    assert_eq!(columns.len(), head.columns(), "one column per statistic");
    let mut columns = columns.into_iter();
    let mut column = || columns.next().expect("counted above");
    LinearLogpOutput {
        logp: column(),
        lse: column(),
        entropy: head.entropy.then(column),
    }
}

/// The `C` columns of `[N, C]` as `[N]` tensors, through one transposing copy: the columns are
/// then contiguous views of it, where taking each column of `[N, C]` would copy it on its own.
pub(crate) fn stats_columns<B: InvariantBackend>(stats: Tensor<B, 2>) -> Vec<Tensor<B, 1>> {
    let [n, c] = stats.dims();
    // `-1`, not `c * n`: a literal 0 would mean "keep the first dimension" for an empty batch.
    let by_column = stats.swap_dims(0, 1).reshape([-1]);
    (0..c)
        .map(|i| by_column.clone().slice(i * n..(i + 1) * n))
        .collect()
}

/// Every check of `linear_logp` (docs/CONTRACT.md, *Errors*), then the registry's choice.
pub(crate) fn check_linear_logp<B: InvariantBackend>(
    hidden: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    targets: &Tensor<B, 1, Int>,
    bias: Option<&Tensor<B, 1>>,
    options: &LinearLogpOptions,
) -> Result<Implementation, InvariantError> {
    options.head(false)?;
    let implementation = check_logits(hidden, weight, ("targets", targets), bias)?;
    let ([n, _], [v, _]) = (hidden.dims(), weight.dims());
    if !options.skip_target_check && n > 0 {
        validate::targets_in_range(targets, v, options.ignore_index)?;
    }
    Ok(implementation)
}

/// The checks of the logits `hidden · weightᵀ + bias` and of a per-row integer tensor named
/// `rows.0` (`linear_logp`'s targets, `linear_sample`'s keys), then the registry's choice.
pub(crate) fn check_logits<B: InvariantBackend>(
    hidden: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    rows: (&'static str, &Tensor<B, 1, Int>),
    bias: Option<&Tensor<B, 1>>,
) -> Result<Implementation, InvariantError> {
    let ([n, d], [v, _]) = (hidden.dims(), weight.dims());
    let (rows_arg, rows) = rows;
    let device = hidden.device();
    validate::float_dtype("hidden", hidden.dtype())?;
    validate::same_dtype("weight", "hidden", hidden.dtype(), weight.dtype())?;
    validate::same_device::<B>("weight", "hidden", &device, &weight.device())?;
    validate::same_device::<B>(rows_arg, "hidden", &device, &rows.device())?;
    validate::dim(
        "weight",
        &weight.dims(),
        1,
        d,
        "the hidden size D of `hidden`",
    )?;
    if v == 0 {
        return Err(InvariantError::Shape {
            arg: "weight",
            expected: "at least one vocabulary row".into(),
            got: weight.dims().to_vec(),
        });
    }
    validate::dim(rows_arg, &rows.dims(), 0, n, "the rows N of `hidden`")?;
    if let Some(bias) = bias {
        validate::same_dtype("bias", "weight", weight.dtype(), bias.dtype())?;
        validate::same_device::<B>("bias", "hidden", &device, &bias.device())?;
        validate::dim(
            "bias",
            &bias.dims(),
            0,
            v,
            "the vocabulary size V of `weight`",
        )?;
    }
    validate::index_limit("hidden", &hidden.dims())?;
    validate::index_limit("weight", &weight.dims())?;
    // The per-row statistics `[N, 3]` and their gradient are indexed by the kernels too.
    validate::index_limit(rows_arg, &[n, 3])?;
    let problem = Problem::LinearLogp { n, d, v };
    implementation_for_problem::<B>(&device, hidden.dtype(), problem)
}
