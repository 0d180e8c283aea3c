//! `InvariantLmHead`: a language model's vocabulary projection, stored `[vocab, d_model]` (the
//! layout of `linear_logp`, of `burn::nn::Embedding` and of Hugging Face's `lm_head`), scored
//! through the fused, batch-invariant `linear_logp*` without a transpose and without `[N, V]`
//! logits; a token per row drawn in the same pass (`linear_sample`), or its logits, where a
//! sampler needs them, through the batch-invariant `linear`.
use burn::config::Config;
use burn::module::{Initializer, Module, Param};
use burn::nn::Embedding;
use burn::tensor::{Int, Tensor};

use crate::{
    InvariantBackend, InvariantError, LinearLogpOptions, LinearLogpOutput, LinearSampleOutput,
    SampleOptions, linear, linear_logp, linear_logp_full, linear_sample,
};

/// Configuration of an [`InvariantLmHead`].
#[derive(Config, Debug)]
pub struct InvariantLmHeadConfig {
    /// The hidden size.
    pub d_model: usize,
    /// The vocabulary size.
    pub vocab: usize,
    /// Whether the head has a bias `[vocab]` (most language models have none).
    #[config(default = false)]
    pub bias: bool,
    /// Initializer of the weight (fan-in `d_model`, fan-out `vocab`) and bias; by default
    /// `burn::nn::LinearConfig`'s.
    #[config(default = "Initializer::KaimingUniform{gain:1.0/3.0f64.sqrt(), fan_out_only:false}")]
    pub initializer: Initializer,
}

/// The LM head: `weight [vocab, d_model]`, `bias [vocab]` optional.
#[derive(Module, Debug)]
pub struct InvariantLmHead<B: InvariantBackend> {
    /// `[vocab, d_model]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[vocab]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
}

impl InvariantLmHeadConfig {
    /// A head initialized as a `burn::nn::Linear` of `d_model → vocab` would be, stored
    /// `[vocab, d_model]`.
    pub fn init<B: InvariantBackend>(&self, device: &B::Device) -> InvariantLmHead<B> {
        let (fan_in, fan_out) = (Some(self.d_model), Some(self.vocab));
        InvariantLmHead {
            weight: self
                .initializer
                .init_with([self.vocab, self.d_model], fan_in, fan_out, device),
            bias: self.bias.then(|| {
                self.initializer
                    .init_with([self.vocab], fan_in, fan_out, device)
            }),
        }
    }
}

impl<B: InvariantBackend> From<Embedding<B>> for InvariantLmHead<B> {
    /// A head tied to an embedding: the same `[vocab, d_model]` parameter.
    fn from(embedding: Embedding<B>) -> Self {
        Self {
            weight: embedding.weight,
            bias: None,
        }
    }
}

impl<B: InvariantBackend> InvariantLmHead<B> {
    /// `log_softmax((hidden · weightᵀ + bias) / T)[target]` per row, f32 `[N]`
    /// ([`crate::linear_logp`]).
    pub fn logp(
        &self,
        hidden: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
        options: &LinearLogpOptions,
    ) -> Result<Tensor<B, 1>, InvariantError> {
        linear_logp(
            hidden,
            self.weight.val(),
            targets,
            self.bias.as_ref().map(Param::val),
            options,
        )
    }

    /// Log-prob, lse and (with `options.entropy`) entropy per row, all f32 `[N]`
    /// ([`crate::linear_logp_full`]).
    pub fn logp_full(
        &self,
        hidden: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
        options: &LinearLogpOptions,
    ) -> Result<LinearLogpOutput<B>, InvariantError> {
        linear_logp_full(
            hidden,
            self.weight.val(),
            targets,
            self.bias.as_ref().map(Param::val),
            options,
        )
    }

    /// A token per row drawn from the tempered softmax with its log-prob, lse and entropy, in
    /// one pass and without `[N, V]` logits ([`crate::linear_sample`]): `keys [N]` name the rows'
    /// noise; `logp` equals [`Self::logp_full`] at `options.logp_options()` bit for bit.
    pub fn sample(
        &self,
        hidden: Tensor<B, 2>,
        keys: Tensor<B, 1, Int>,
        options: &SampleOptions,
    ) -> Result<LinearSampleOutput<B>, InvariantError> {
        linear_sample(
            hidden,
            self.weight.val(),
            keys,
            self.bias.as_ref().map(Param::val),
            options,
        )
    }

    /// The logits `hidden · weightᵀ + bias`, `[.., vocab]` in the hidden's dtype, by the
    /// batch-invariant [`crate::linear`] on the transposed view (no copy): for a sampler that
    /// needs them, with a row's logits independent of the batch. Not the f32 logits
    /// `linear_logp` reduces (those are never stored).
    pub fn logits<const D: usize>(
        &self,
        hidden: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, InvariantError> {
        linear(
            hidden,
            self.weight.val().transpose(),
            self.bias.as_ref().map(Param::val),
        )
    }
}
