//! `attention`: causal GQA attention whose KV-cache decode equals prefill bitwise
//! (docs/CONTRACT.md, *attention semantics*).
mod api;
mod autodiff;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "cubecl")]
mod fusion;
pub mod oracle;
mod reference;

use burn::tensor::{
    backend::Backend,
    ops::{FloatTensor, IntTensor},
};

use crate::InvariantError;
use crate::registry::Implementation;

pub use api::{attention, attention_with_lens};

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
