//! `InvariantRmsNorm`: a drop-in for `burn::nn::RmsNorm` computed by [`crate::rms_norm`].
use burn::config::Config;
use burn::module::{Initializer, Module, Param};
use burn::nn::RmsNorm;
use burn::tensor::Tensor;

use crate::{InvariantBackend, InvariantError};

/// Configuration of an [`InvariantRmsNorm`]; the same fields and defaults as
/// `burn::nn::RmsNormConfig`.
#[derive(Config, Debug)]
pub struct InvariantRmsNormConfig {
    /// The size of the normalized (last) dimension.
    pub d_model: usize,
    /// Added to the mean square for numerical stability.
    #[config(default = 1e-5)]
    pub epsilon: f64,
}

/// RMS normalization over the last dimension, `y = x / sqrt(mean(x²) + ε) · γ`, computed by
/// the batch-invariant [`crate::rms_norm`].
///
/// Field names (`gamma [d_model]`, `epsilon`) match `burn::nn::RmsNorm`, so records load into
/// either.
#[derive(Module, Debug)]
pub struct InvariantRmsNorm<B: InvariantBackend> {
    /// `[d_model]`, initialized to ones.
    pub gamma: Param<Tensor<B, 1>>,
    /// Added to the mean square.
    pub epsilon: f64,
}

impl InvariantRmsNormConfig {
    /// Initializes the layer as `burn::nn::RmsNormConfig::init` would (γ = 1), or an error
    /// for an `epsilon` that is not finite and > 0.
    pub fn init<B: InvariantBackend>(
        &self,
        device: &B::Device,
    ) -> Result<InvariantRmsNorm<B>, InvariantError> {
        if !(self.epsilon > 0.0 && self.epsilon.is_finite()) {
            return Err(InvariantError::InvalidArgument {
                arg: "epsilon",
                reason: format!("must be finite and > 0, got {}", self.epsilon),
            });
        }
        Ok(InvariantRmsNorm {
            gamma: Initializer::Ones.init([self.d_model], device),
            epsilon: self.epsilon,
        })
    }
}

impl<B: InvariantBackend> From<RmsNorm<B>> for InvariantRmsNorm<B> {
    fn from(norm: RmsNorm<B>) -> Self {
        Self {
            gamma: norm.gamma,
            epsilon: norm.epsilon,
        }
    }
}

impl<B: InvariantBackend> From<InvariantRmsNorm<B>> for RmsNorm<B> {
    fn from(norm: InvariantRmsNorm<B>) -> Self {
        Self {
            gamma: norm.gamma,
            epsilon: norm.epsilon,
        }
    }
}

impl<B: InvariantBackend> InvariantRmsNorm<B> {
    /// `x [..., d_model]` → the same shape, batch-invariant per row.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, InvariantError> {
        crate::rms_norm(x, self.gamma.val(), self.epsilon)
    }
}
