//! Modules: `InvariantLinear`, a drop-in for `burn::nn::Linear` whose forward (and backward) is
//! the batch-invariant [`crate::linear`]; [`InvariantRmsNorm`], a drop-in for
//! `burn::nn::RmsNorm`; [`InvariantAttention`] with its [`KvCache`]; and [`InvariantLmHead`],
//! the `[vocab, d_model]` head scored by `linear_logp*`.
mod attention;
mod lm_head;
mod rms_norm;

pub use attention::{InvariantAttention, InvariantAttentionConfig, KvCache, RopeTables};
use burn::config::Config;
use burn::module::{Initializer, Module, Param};
use burn::nn::{Linear, LinearConfig, LinearLayout};
use burn::tensor::Tensor;
pub use lm_head::{InvariantLmHead, InvariantLmHeadConfig};
pub use rms_norm::{InvariantRmsNorm, InvariantRmsNormConfig};

use crate::{InvariantBackend, InvariantError};

/// Configuration of an [`InvariantLinear`]; the same fields and defaults as
/// `burn::nn::LinearConfig`.
#[derive(Config, Debug)]
pub struct InvariantLinearConfig {
    /// The size of the input features.
    pub d_input: usize,
    /// The size of the output features.
    pub d_output: usize,
    /// If a bias should be applied during the linear transformation.
    #[config(default = true)]
    pub bias: bool,
    /// The type of function used to initialize neural network parameters.
    #[config(default = "Initializer::KaimingUniform{gain:1.0/3.0f64.sqrt(), fan_out_only:false}")]
    pub initializer: Initializer,
    /// The layout in which the parameters are stored (as in `burn::nn::LinearConfig`).
    #[config(default = "LinearLayout::Row")]
    pub layout: LinearLayout,
}

/// A linear layer, `O = IW + b`, computed by the batch-invariant [`crate::linear`].
///
/// Field names (`weight [d_input, d_output]`, `bias [d_output]`) match `burn::nn::Linear`, so
/// records load into either.
#[derive(Module, Debug)]
pub struct InvariantLinear<B: InvariantBackend> {
    /// `[d_input, d_output]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[d_output]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
}

impl InvariantLinearConfig {
    /// Initializes the layer exactly as `burn::nn::LinearConfig::init` would.
    pub fn init<B: InvariantBackend>(&self, device: &B::Device) -> InvariantLinear<B> {
        LinearConfig {
            d_input: self.d_input,
            d_output: self.d_output,
            bias: self.bias,
            initializer: self.initializer.clone(),
            layout: self.layout,
        }
        .init(device)
        .into()
    }
}

impl<B: InvariantBackend> From<Linear<B>> for InvariantLinear<B> {
    fn from(linear: Linear<B>) -> Self {
        Self {
            weight: linear.weight,
            bias: linear.bias,
        }
    }
}

impl<B: InvariantBackend> From<InvariantLinear<B>> for Linear<B> {
    fn from(linear: InvariantLinear<B>) -> Self {
        Self {
            weight: linear.weight,
            bias: linear.bias,
        }
    }
}

impl<B: InvariantBackend> InvariantLinear<B> {
    /// `input [..., d_input]` → `[..., d_output]`, batch-invariant per row.
    pub fn forward<const D: usize>(
        &self,
        input: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, InvariantError> {
        crate::linear(
            input,
            self.weight.val(),
            self.bias.as_ref().map(|b| b.val()),
        )
    }
}
