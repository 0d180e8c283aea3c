//! A small Llama-style policy built from burn-invariant's modules only: token embedding (a
//! gather), `n_layers` pre-norm blocks of [`InvariantRmsNorm`] → [`InvariantAttention`] (GQA,
//! RoPE, KV cache) → residual → [`InvariantRmsNorm`] → SwiGLU MLP of [`InvariantLinear`] →
//! residual, a final [`InvariantRmsNorm`], and an [`InvariantLmHead`] `[vocab, d_model]` scored
//! through `linear_logp_full`.
//!
//! Two paths compute the same hidden states, bitwise: [`Policy::trainer`] (one causal prefill of
//! right-padded sequences, differentiable) and [`Policy::step`] (the rollout: left-padded tokens
//! appended to per-layer [`KvCache`]s, one or many tokens per call).
//!
//! Shared by `examples/transformer_rollout/main.rs` and `tests/common/model.rs` (through
//! `#[path]`), each of which uses part of it.
#![allow(dead_code)]

use burn::module::{Module, Param};
use burn::tensor::{DType, Int, Tensor, TensorData, activation::silu, backend::Backend};
use burn_invariant::nn::{
    InvariantAttention, InvariantAttentionConfig, InvariantLinear, InvariantLmHead,
    InvariantRmsNorm, KvCache,
};
use burn_invariant::{
    InvariantBackend, InvariantError, LinearLogpOptions, LinearLogpOutput, LinearSampleOutput,
    SampleOptions,
};

/// Sizes and the head's options.
#[derive(Debug, Clone, Copy)]
pub struct PolicyConfig {
    pub vocab: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Width of the SwiGLU MLP.
    pub d_ff: usize,
    /// Longest position the rotary tables (and so any cache) cover.
    pub max_seq_len: usize,
    /// Sampling (and scoring) temperature of the head.
    pub temperature: f64,
    /// Target value of rows that are not scored.
    pub ignore_index: i64,
    /// The end-of-sequence token, whose head row is scaled by `eos_gain` (how often sampled
    /// responses end early).
    pub eos: usize,
    pub eos_gain: f32,
    /// Seed of the weight formula.
    pub seed: u64,
}

/// xorshift64: the seeded weight formula (and the example's sampler).
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in `[0, 1)`, 24 bits: exact in f32.
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `[-scale, scale)`.
    pub fn symmetric(&mut self, scale: f32) -> f32 {
        (2.0 * self.unit() - 1.0) * scale
    }
}

/// splitmix64's output function: a bijective 64-bit mix.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// splitmix64's increment.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The stream of tensor `id` under `seed`.
fn stream(seed: u64, id: u64) -> u64 {
    mix64(seed.wrapping_add(id.wrapping_mul(0xD1B5_4A32_D192_ED03)))
}

/// Hash `i` of stream `(seed, id)`: a pure function of the index, so large tensors fill in
/// parallel and `benches/whole_model.py` computes the same bits vectorized.
pub fn hash_at(seed: u64, id: u64, i: u64) -> u64 {
    mix64(stream(seed, id).wrapping_add((i + 1).wrapping_mul(GOLDEN)))
}

/// `n` values uniform in `[-scale, scale)`: `(2u − 1)·scale` in f32, `u` the top 24 bits of
/// [`hash_at`] over 2²⁴ (exact in f32).
pub fn hashed_uniform(seed: u64, id: u64, n: usize, scale: f32) -> Vec<f32> {
    use rayon::prelude::*;
    (0..n as u64)
        .into_par_iter()
        .map(|i| {
            let u = (hash_at(seed, id, i) >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * u - 1.0) * scale
        })
        .collect()
}

/// `n` tokens in `[0, vocab)`: bits 33..64 of [`hash_at`] modulo `vocab`.
pub fn hashed_tokens(seed: u64, id: u64, n: usize, vocab: usize) -> Vec<i64> {
    (0..n as u64)
        .map(|i| ((hash_at(seed, id, i) >> 33) % vocab as u64) as i64)
        .collect()
}

/// A `Param` from host f32 values, rounded once to `dtype` (bf16 on the host, in parallel:
/// a billion-element embedding converts in a fraction of a second).
fn host_param<B: Backend, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &B::Device,
    dtype: DType,
) -> Param<Tensor<B, D>> {
    use rayon::prelude::*;
    let data = if dtype == DType::BF16 {
        let bf: Vec<half::bf16> = values.into_par_iter().map(half::bf16::from_f32).collect();
        TensorData::new(bf, shape)
    } else {
        TensorData::new(values, shape)
    };
    Param::from_tensor(Tensor::from_data(data, (device, dtype)))
}

/// One pre-norm transformer block.
#[derive(Module, Debug)]
pub struct Block<B: InvariantBackend> {
    pub attn_norm: InvariantRmsNorm<B>,
    pub attn: InvariantAttention<B>,
    pub mlp_norm: InvariantRmsNorm<B>,
    /// `[d_model, d_ff]`.
    pub gate: InvariantLinear<B>,
    /// `[d_model, d_ff]`.
    pub up: InvariantLinear<B>,
    /// `[d_ff, d_model]`.
    pub down: InvariantLinear<B>,
}

impl<B: InvariantBackend> Block<B> {
    /// `x [B, S, d_model]`; `cache` selects the rollout path (left-padded `x`, the last
    /// `new_lens[b]` positions of row `b` are new) instead of the trainer's causal prefill.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        cache: Option<(&mut KvCache<B>, &[usize])>,
    ) -> Result<Tensor<B, 3>, InvariantError> {
        let h = self.attn_norm.forward(x.clone())?;
        let a = match cache {
            None => self.attn.forward(h)?,
            Some((cache, new_lens)) => self.attn.forward_cached(h, cache, new_lens)?,
        };
        let x = x + a;
        let h = self.mlp_norm.forward(x.clone())?;
        let mlp = silu(self.gate.forward(h.clone())?) * self.up.forward(h)?;
        Ok(x + self.down.forward(mlp)?)
    }
}

/// The policy: embedding, blocks, final norm and LM head.
#[derive(Module, Debug)]
pub struct Policy<B: InvariantBackend> {
    /// `[vocab, d_model]`.
    pub embed: Param<Tensor<B, 2>>,
    pub blocks: Vec<Block<B>>,
    pub norm: InvariantRmsNorm<B>,
    /// `[vocab, d_model]`, scored by `linear_logp_full`.
    pub head: InvariantLmHead<B>,
    #[module(skip)]
    pub config: PolicyConfig,
}

/// A `Param` of `shape` in `dtype` holding `value(i)` for the flat index `i`, from host f32.
fn param<B: Backend, const D: usize>(
    shape: [usize; D],
    device: &B::Device,
    dtype: DType,
    mut value: impl FnMut() -> f32,
) -> Param<Tensor<B, D>> {
    let data: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|_| value())
        .collect();
    Param::from_tensor(Tensor::from_data(
        TensorData::new(data, shape),
        (device, dtype),
    ))
}

impl<B: InvariantBackend> Policy<B> {
    /// Weights from the seeded formula: the same values on every backend and run (rounded
    /// once to `dtype`).
    pub fn new(
        config: PolicyConfig,
        device: &B::Device,
        dtype: DType,
    ) -> Result<Self, InvariantError> {
        let c = config;
        let mut rng = XorShift::new(c.seed);
        let mut uniform = |shape: &[usize], scale: f32| -> Vec<f32> {
            (0..shape.iter().product::<usize>())
                .map(|_| rng.symmetric(scale))
                .collect()
        };
        // Uniform(−a, a) with a = sqrt(3 / fan_in): unit variance through each projection.
        let fan = |d_in: usize| (3.0 / d_in as f32).sqrt();
        let mut linear = |d_in: usize, d_out: usize| -> InvariantLinear<B> {
            let values = uniform(&[d_in, d_out], fan(d_in));
            let mut it = values.into_iter();
            InvariantLinear {
                weight: param([d_in, d_out], device, dtype, || it.next().unwrap_or(0.0)),
                bias: None,
            }
        };
        let norm = |rng: &mut XorShift| InvariantRmsNorm {
            gamma: param([c.d_model], device, dtype, || 1.0 + rng.symmetric(0.1)),
            epsilon: 1e-5,
        };
        let (q_width, kv_width) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let mut blocks = Vec::with_capacity(c.n_layers);
        for _ in 0..c.n_layers {
            // The config builds the rotary tables; the projections are replaced.
            let mut attn =
                InvariantAttentionConfig::new(c.d_model, c.n_heads, c.n_kv_heads, c.head_dim)
                    .with_max_seq_len(c.max_seq_len)
                    .init::<B>(device)?;
            attn.query = linear(c.d_model, q_width);
            attn.key = linear(c.d_model, kv_width);
            attn.value = linear(c.d_model, kv_width);
            attn.output = linear(q_width, c.d_model);
            let gate = linear(c.d_model, c.d_ff);
            let up = linear(c.d_model, c.d_ff);
            let down = linear(c.d_ff, c.d_model);
            blocks.push((attn, gate, up, down));
        }
        let mut rng = XorShift::new(c.seed ^ 0x5EED);
        let blocks = blocks
            .into_iter()
            .map(|(attn, gate, up, down)| Block {
                attn_norm: norm(&mut rng),
                attn,
                mlp_norm: norm(&mut rng),
                gate,
                up,
                down,
            })
            .collect();
        let final_norm = norm(&mut rng);
        let embed = param([c.vocab, c.d_model], device, dtype, || rng.symmetric(1.0));
        // Logits of a few units: neither flat nor one-hot at the sampling temperature.
        let head_scale = 2.0 * fan(c.d_model);
        let mut i = 0;
        let head = param([c.vocab, c.d_model], device, dtype, || {
            let gain = if i / c.d_model == c.eos {
                c.eos_gain
            } else {
                1.0
            };
            i += 1;
            rng.symmetric(head_scale) * gain
        });
        Ok(Self {
            embed,
            blocks,
            norm: final_norm,
            head: InvariantLmHead {
                weight: head,
                bias: None,
            },
            config,
        })
    }

    /// Weights from the per-index formula [`hashed_uniform`] (for real layer shapes: seconds,
    /// where [`Self::new`]'s sequential xorshift takes minutes). Tensor ids: embedding 0, head
    /// 1, final norm 2; layer `l` from `16·(l + 1)`: attention norm +0, q +1, k +2, v +3,
    /// output +4, MLP norm +5, gate +6, up +7, down +8. Linear weights `[d_in, d_out]` are
    /// uniform in ±sqrt(3 / d_in), norms 1 ± 0.1, the embedding ±1, the head ±2·sqrt(3 /
    /// d_model); `eos_gain` is not applied.
    pub fn hashed(
        config: PolicyConfig,
        device: &B::Device,
        dtype: DType,
    ) -> Result<Self, InvariantError> {
        let c = config;
        let fan = |d_in: usize| (3.0 / d_in as f32).sqrt();
        let linear = |id: u64, d_in: usize, d_out: usize| InvariantLinear {
            weight: host_param(
                hashed_uniform(c.seed, id, d_in * d_out, fan(d_in)),
                [d_in, d_out],
                device,
                dtype,
            ),
            bias: None,
        };
        let norm = |id: u64| {
            let gamma = hashed_uniform(c.seed, id, c.d_model, 0.1);
            InvariantRmsNorm {
                gamma: host_param(
                    gamma.into_iter().map(|g| 1.0 + g).collect(),
                    [c.d_model],
                    device,
                    dtype,
                ),
                epsilon: 1e-5,
            }
        };
        let (q_width, kv_width) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let mut blocks = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers as u64 {
            let id = 16 * (l + 1);
            // The config builds the rotary tables; the projections are replaced.
            let mut attn =
                InvariantAttentionConfig::new(c.d_model, c.n_heads, c.n_kv_heads, c.head_dim)
                    .with_max_seq_len(c.max_seq_len)
                    .init::<B>(device)?;
            attn.query = linear(id + 1, c.d_model, q_width);
            attn.key = linear(id + 2, c.d_model, kv_width);
            attn.value = linear(id + 3, c.d_model, kv_width);
            attn.output = linear(id + 4, q_width, c.d_model);
            blocks.push(Block {
                attn_norm: norm(id),
                attn,
                mlp_norm: norm(id + 5),
                gate: linear(id + 6, c.d_model, c.d_ff),
                up: linear(id + 7, c.d_model, c.d_ff),
                down: linear(id + 8, c.d_ff, c.d_model),
            });
        }
        let table = |id: u64, scale: f32| {
            let values = hashed_uniform(c.seed, id, c.vocab * c.d_model, scale);
            host_param(values, [c.vocab, c.d_model], device, dtype)
        };
        Ok(Self {
            embed: table(0, 1.0),
            blocks,
            norm: norm(2),
            head: InvariantLmHead {
                weight: table(1, 2.0 * fan(c.d_model)),
                bias: None,
            },
            config,
        })
    }

    /// The head's options: temperature, entropy, ignore index.
    pub fn head_options(&self) -> LinearLogpOptions {
        LinearLogpOptions::default()
            .with_ignore_index(self.config.ignore_index)
            .with_temperature(self.config.temperature)
            .with_entropy(true)
    }

    /// Scores `targets [N]` under `hidden [N, d_model]` (final-normed): log-prob, lse and
    /// entropy at the temperature, the same call for rollout and trainer.
    pub fn score(
        &self,
        hidden: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> Result<LinearLogpOutput<B>, InvariantError> {
        self.head.logp_full(hidden, targets, &self.head_options())
    }

    /// Draws the next token of each row at the temperature, with its log-prob and entropy (those
    /// [`Self::score`] gives for it, bit for bit), in one pass over the vocabulary: `keys [N]` name
    /// the rows' noise, so a rerun with the same seed and keys draws the same tokens.
    pub fn sample(
        &self,
        hidden: Tensor<B, 2>,
        keys: Tensor<B, 1, Int>,
        seed: u64,
    ) -> Result<LinearSampleOutput<B>, InvariantError> {
        let options = SampleOptions::default()
            .with_seed(seed)
            .with_temperature(self.config.temperature)
            .with_entropy(true);
        self.head.sample(hidden, keys, &options)
    }

    fn embed(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        burn::tensor::module::embedding(self.embed.val(), tokens)
    }

    /// The trainer's path: final-normed hidden states `[B, L, d_model]` of right-padded
    /// `tokens [B, L]`, one causal prefill.
    pub fn hidden(&self, tokens: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>, InvariantError> {
        let mut x = self.embed(tokens);
        for block in &self.blocks {
            x = block.forward(x, None)?;
        }
        self.norm.forward(x)
    }

    /// One trainer call: `tokens [B, L]` right-padded, `targets [B · L]` (the next token, or
    /// the ignore index on prompt and padding positions) → the head's outputs, `[B · L]` each.
    pub fn trainer(
        &self,
        tokens: Tensor<B, 2, Int>,
        targets: Tensor<B, 1, Int>,
    ) -> Result<LinearLogpOutput<B>, InvariantError> {
        let [batch, len] = tokens.dims();
        let hidden = self.hidden(tokens)?;
        self.score(hidden.reshape([batch * len, self.config.d_model]), targets)
    }

    /// Empty KV caches (one per layer) for `batch` rows of up to `capacity` positions.
    pub fn new_caches(&self, batch: usize, capacity: usize) -> Vec<KvCache<B>> {
        let c = &self.config;
        let device = self.head.weight.val().device();
        let dtype = self.head.weight.val().dtype();
        (0..c.n_layers)
            .map(|_| KvCache::new(batch, c.n_kv_heads, capacity, c.head_dim, dtype, &device))
            .collect()
    }

    /// The rollout's path over the caches: `tokens [B, S]` left-padded (row `b`'s new tokens
    /// are its last `new_lens[b]`), appended to `caches` (one per layer) → final-normed hidden
    /// states `[B, S, d_model]` (rows' padding positions hold values of no meaning).
    pub fn hidden_cached(
        &self,
        tokens: Tensor<B, 2, Int>,
        caches: &mut [KvCache<B>],
        new_lens: &[usize],
    ) -> Result<Tensor<B, 3>, InvariantError> {
        if caches.len() != self.blocks.len() {
            return Err(InvariantError::Shape {
                arg: "caches",
                expected: format!("one cache per layer ({})", self.blocks.len()),
                got: vec![caches.len()],
            });
        }
        let mut x = self.embed(tokens);
        for (block, cache) in self.blocks.iter().zip(caches.iter_mut()) {
            x = block.forward(x, Some((cache, new_lens)))?;
        }
        self.norm.forward(x)
    }

    /// One rollout step (a prefill chunk or a decode step, see [`Self::hidden_cached`]) → the
    /// final-normed hidden state of each row's last position, `[B, d_model]`.
    pub fn step(
        &self,
        tokens: Tensor<B, 2, Int>,
        caches: &mut [KvCache<B>],
        new_lens: &[usize],
    ) -> Result<Tensor<B, 2>, InvariantError> {
        let [batch, seq] = tokens.dims();
        let d = self.config.d_model;
        let hidden = self.hidden_cached(tokens, caches, new_lens)?;
        Ok(hidden
            .slice([0..batch, seq - 1..seq, 0..d])
            .reshape([batch, d]))
    }
}

/// Keeps `rows` (in that order) of every layer's cache: the batch shrinks as sequences end.
pub fn select_rows<B: Backend>(
    caches: &[KvCache<B>],
    rows: &[usize],
) -> Result<Vec<KvCache<B>>, InvariantError> {
    caches.iter().map(|c| c.select_rows(rows)).collect()
}

/// `rows` of tokens as one `[rows, width]` tensor, each left-padded (`left = true`) or
/// right-padded with `pad`.
pub fn padded_tokens<B: Backend>(
    rows: &[&[i64]],
    width: usize,
    pad: i64,
    left: bool,
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    let mut data = Vec::with_capacity(rows.len() * width);
    for row in rows {
        let fill = std::iter::repeat_n(pad, width - row.len());
        if left {
            data.extend(fill.chain(row.iter().copied()));
        } else {
            data.extend(row.iter().copied().chain(fill));
        }
    }
    Tensor::from_data(TensorData::new(data, [rows.len(), width]), device)
}
