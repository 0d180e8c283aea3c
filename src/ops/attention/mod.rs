//! `attention`: causal GQA attention whose KV-cache decode equals prefill bitwise
//! (docs/CONTRACT.md, *attention semantics*).
mod autodiff;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "cubecl")]
mod fusion;
pub mod oracle;
mod reference;

use burn::tensor::{
    Int, Tensor, TensorData,
    backend::Backend,
    ops::{FloatTensor, IntTensor},
};

use crate::backend::Problem;
use crate::backends::generic::{float_primitive, float_tensor};
use crate::registry::{Implementation, Op};
use crate::{InvariantBackend, InvariantError, api, validate};

/// Options of [`attention`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOptions {
    /// Query `i` sees only keys up to its position (default `true`).
    pub causal: bool,
    /// Score scale; `None` (the default) is `1/sqrt(head_dim)`. Finite.
    pub scale: Option<f64>,
}

impl Default for AttentionOptions {
    fn default() -> Self {
        Self {
            causal: true,
            scale: None,
        }
    }
}

impl AttentionOptions {
    /// Sets [`Self::causal`].
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Sets [`Self::scale`].
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }

    /// The scale as the kernels take it, checked.
    fn scale_f32(&self, head_dim: usize) -> Result<f32, InvariantError> {
        let scale = self
            .scale
            .unwrap_or_else(|| 1.0 / (head_dim.max(1) as f64).sqrt());
        let rounded = scale as f32;
        if scale.is_finite() && rounded.is_finite() {
            Ok(rounded)
        } else {
            Err(InvariantError::InvalidArgument {
                arg: "scale",
                reason: format!("must be finite as an f32, got {scale}"),
            })
        }
    }
}

/// Inputs of the attention primitives, validated.
#[derive(Debug, Clone)]
pub struct AttentionInputs<B: Backend> {
    /// `[B, H, Q, Dh]`.
    pub query: FloatTensor<B>,
    /// `[B, KH, KV, Dh]`, `H % KH == 0`.
    pub key: FloatTensor<B>,
    /// `[B, KH, KV, Dh]`.
    pub value: FloatTensor<B>,
    /// `[B]`, each in `[0, KV]`: the valid keys of each row.
    pub kv_lens: IntTensor<B>,
    /// Whether query `i` sees only keys up to its position.
    pub causal: bool,
    /// Score scale.
    pub scale: f32,
}

/// What the attention forward returns: the output and the only state its backward needs.
#[derive(Debug, Clone)]
pub struct AttentionOutput<B: Backend> {
    /// `[B, H, Q, Dh]` in the input dtype.
    pub out: FloatTensor<B>,
    /// `[B, H, Q]` f32 `logsumexp` of each query's scaled scores (−∞ for a query at a negative
    /// position).
    pub lse: FloatTensor<B>,
}

/// Gradients of attention, each in its input's dtype and shape.
#[derive(Debug, Clone)]
pub struct AttentionGrads<B: Backend> {
    /// `dQuery`.
    pub query: FloatTensor<B>,
    /// `dKey`.
    pub key: FloatTensor<B>,
    /// `dValue`.
    pub value: FloatTensor<B>,
}

/// The attention primitives of a backend. They receive validated inputs and the
/// implementation the registry chose, and never fail.
pub trait AttentionOps: Backend {
    /// Forward (docs/CONTRACT.md, *attention semantics*).
    fn invariant_attention(
        inputs: AttentionInputs<Self>,
        implementation: Implementation,
    ) -> AttentionOutput<Self>;

    /// Backward from the forward's `out` and `lse` and the upstream `grad` (`[B, H, Q, Dh]`):
    /// query rows whose `grad` is all zero contribute nothing.
    fn invariant_attention_backward(
        inputs: AttentionInputs<Self>,
        saved: AttentionOutput<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> AttentionGrads<Self>;
}

/// Deterministic, batch-invariant attention: `softmax(q·kᵀ·scale)·v` per query over the keys
/// it sees, with grouped KV heads.
///
/// `query [B, H, Q, Dh]`, `key`/`value [B, KH, KV, Dh]` with `H % KH == 0` (query head `h`
/// reads KV head `h / (H / KH)`), `kv_lens [B]` the valid keys of each row (`None`: all `KV`).
/// Query `i` of row `b` sits at position `kv_lens[b] − Q + i`; with `options.causal` it sees
/// keys `0..=pos`, otherwise all of the row's keys; a query at a negative position outputs
/// zeros. `out[b, h, i, :]` depends only on that query, the keys and values it sees and the
/// scale: KV-cache decode equals prefill, a row alone equals the row in any batch, chunked
/// prefill equals one call — bitwise. Differentiable under `Autodiff`.
pub fn attention<B: InvariantBackend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    kv_lens: Option<Tensor<B, 1, Int>>,
    options: &AttentionOptions,
) -> Result<Tensor<B, 4>, InvariantError> {
    let [batch, heads, q_len, head_dim] = query.dims();
    let [_, kv_heads, kv_len, _] = key.dims();
    let device = query.device();
    validate::float_dtype("query", query.dtype())?;
    validate::same_dtype("key", "query", query.dtype(), key.dtype())?;
    validate::same_dtype("value", "query", query.dtype(), value.dtype())?;
    validate::same_device::<B>("key", "query", &device, &key.device())?;
    validate::same_device::<B>("value", "query", &device, &value.device())?;
    validate::dim("key", &key.dims(), 0, batch, "the batch B of `query`")?;
    validate::dim("key", &key.dims(), 3, head_dim, "the head size of `query`")?;
    if value.dims() != key.dims() {
        return Err(InvariantError::Shape {
            arg: "value",
            expected: format!("the shape of `key`, {:?}", key.dims()),
            got: value.dims().to_vec(),
        });
    }
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(InvariantError::Shape {
            arg: "key",
            expected: format!(
                "dimension 1 (KV heads) ≥ 1 and dividing the {heads} query heads of `query`"
            ),
            got: key.dims().to_vec(),
        });
    }
    if options.causal && q_len > kv_len {
        return Err(InvariantError::InvalidArgument {
            arg: "query",
            reason: format!(
                "causal attention over {kv_len} keys takes at most {kv_len} queries (queries \
                 are the newest positions), got {q_len}"
            ),
        });
    }
    let scale = options.scale_f32(head_dim)?;
    for (arg, shape) in [
        ("query", query.dims()),
        ("key", key.dims()),
        ("value", value.dims()),
    ] {
        validate::index_limit(arg, &shape)?;
    }
    let kv_lens = match kv_lens {
        Some(lens) => {
            validate::same_device::<B>("kv_lens", "query", &device, &lens.device())?;
            validate::dim("kv_lens", &lens.dims(), 0, batch, "the batch B of `query`")?;
            validate::lengths_in_range(&lens, "kv_lens", kv_len)?;
            lens
        }
        None => Tensor::from_data(
            TensorData::new(vec![kv_len as i64; batch], [batch]),
            &device,
        ),
    };
    let problem = Problem::Attention {
        batch,
        heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
    };
    let implementation =
        api::implementation_for_problem::<B>(Op::Attention, &device, query.dtype(), problem)?;
    let inputs = AttentionInputs {
        query: float_primitive(query),
        key: float_primitive(key),
        value: float_primitive(value),
        kv_lens: kv_lens.into_primitive(),
        causal: options.causal,
        scale,
    };
    Ok(float_tensor(
        B::invariant_attention(inputs, implementation).out,
    ))
}
