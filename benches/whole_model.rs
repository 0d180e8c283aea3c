//! Whole-model timing: one rollout step and one training step of a Llama-style
//! policy with real layer shapes, ours (`examples/transformer_rollout/model.rs`, every op from
//! this crate) beside the same model built from Burn's own ops (`BurnPolicy`: `burn::nn::Linear`,
//! `burn::nn::RmsNorm`, `burn::tensor::module::attention` with K/V repeated to the query heads,
//! materialized logits + `log_softmax` + gather), the same weights (`Policy::hashed`, a per-index
//! formula that `benches/whole_model.py` reproduces for PyTorch).
//!
//! - rollout: one decode step, `WM_DECODE_BATCH` (64) rows over `WM_CONTEXT` (2048) cached
//!   tokens (filled by an untimed prefill; each timed step appends one more), → each row's
//!   log-prob of a given next token (sampling excluded on every side);
//! - training: forward + backward of `WM_TRAIN_BATCH × WM_TRAIN_LEN` (8 × 2048) tokens under
//!   `Autodiff`, loss `−mean log-prob` of the next tokens, gradients w.r.t. every parameter.
//!
//! Modes (first argument): `ours` (the registry default, or what `BURN_INVARIANT_IMPL` forces),
//! `burn`, and `check`: a tiny config in f32 on NdArray (the Reference backend) printing the
//! per-token log-probs as `CHECK logp i value` for the PyTorch side to compare with, and checking
//! `BurnPolicy` (trainer and decode) against ours. `check` needs no GPU:
//! `cargo test --bench whole_model -- check`. On CUDA:
//! `cargo bench --features cuda --bench whole_model -- ours` (or the built binary, see
//! `benches/device_run.sh wholemodel`).
//!
//! Sizes (env): `WM_LAYERS` 4, `WM_D_MODEL` 4096, `WM_HEADS` 32, `WM_KV_HEADS` 8, `WM_HEAD_DIM`
//! 128, `WM_D_FF` 14336, `WM_VOCAB` 128256, `WM_DECODE_BATCH` 64, `WM_CONTEXT` 2048,
//! `WM_TRAIN_BATCH` 8, `WM_TRAIN_LEN` 2048, `WM_WARMUP` 2, `WM_REPS` 7. Each step is timed as the
//! median of `WM_REPS` device-synced calls after `WM_WARMUP`; a step that panics (out of memory,
//! say) prints `SKIP` and `NA`. Output: `RESULT whole_model <variant> impl=.. rollout_ms=..
//! train_ms=.. rollout_mean_logp=.. train_loss=..`. If a variant does not fit in 78 GiB (Burn's
//! training step materializes `[8, 32, 2048, 2048]` attention scores per layer and f32 logits
//! `[16384, 128256]`), rerun with `WM_TRAIN_BATCH=4` (or `WM_VOCAB=32000`) for every variant.
#[path = "../examples/transformer_rollout/model.rs"]
mod model;

use burn::module::Param;
use burn::nn::{Linear, RmsNorm};
use burn::tensor::activation::{log_softmax, silu};
use burn::tensor::backend::Backend;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_invariant::{InvariantBackend, LinearLogpOptions};
use model::{Policy, PolicyConfig, hashed_tokens};

/// Token streams of the formula (`hashed_tokens` ids), shared with `whole_model.py`.
const TRAIN_TOKENS: u64 = 1000;
const ROPE_THETA: f64 = 10000.0;

/// Model and step sizes.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    layers: usize,
    d_model: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    d_ff: usize,
    vocab: usize,
    decode_batch: usize,
    context: usize,
    train_batch: usize,
    train_len: usize,
    warmup: usize,
    reps: usize,
    seed: u64,
}

impl Sizes {
    /// The f32 check's config (`whole_model.py` has the same numbers).
    fn check() -> Self {
        Self {
            layers: 2,
            d_model: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            d_ff: 128,
            vocab: 300,
            decode_batch: 2,
            context: 16,
            train_batch: 2,
            train_len: 17,
            warmup: 0,
            reps: 1,
            seed: 7,
        }
    }

    /// Decode positions: the prefill, warm-up and timed steps.
    fn capacity(&self) -> usize {
        self.context + self.warmup + self.reps
    }

    fn policy(&self) -> PolicyConfig {
        PolicyConfig {
            vocab: self.vocab,
            d_model: self.d_model,
            n_layers: self.layers,
            n_heads: self.heads,
            n_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            d_ff: self.d_ff,
            max_seq_len: self.capacity().max(self.train_len),
            temperature: 1.0,
            ignore_index: -100,
            eos: 1,
            eos_gain: 1.0,
            seed: self.seed,
        }
    }

    fn describe(&self) -> String {
        format!(
            "layers={} d_model={} heads={}/{} head_dim={} d_ff={} vocab={} decode={}x{} train={}x{}",
            self.layers,
            self.d_model,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.d_ff,
            self.vocab,
            self.decode_batch,
            self.context,
            self.train_batch,
            self.train_len
        )
    }
}

fn ints2<B: Backend>(data: Vec<i64>, shape: [usize; 2], device: &B::Device) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(data, shape), device)
}

fn ints1<B: Backend>(data: Vec<i64>, device: &B::Device) -> Tensor<B, 1, Int> {
    let n = data.len();
    Tensor::from_data(TensorData::new(data, [n]), device)
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

/// The training batch: `tokens [B, L]` and the next tokens `[B · L]`, from rows of `L + 1`.
fn train_batch<B: Backend>(
    s: &Sizes,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 1, Int>) {
    let (b, l) = (s.train_batch, s.train_len);
    let seq = hashed_tokens(s.seed, TRAIN_TOKENS, b * (l + 1), s.vocab);
    let rows = || seq.chunks(l + 1);
    let tokens = rows().flat_map(|r| r[..l].to_vec()).collect();
    let targets = rows().flat_map(|r| r[1..].to_vec()).collect();
    (ints2(tokens, [b, l], device), ints1(targets, device))
}

/// What the timed steps need of a model.
trait Model<B: Backend> {
    /// Per-layer KV caches.
    type Cache;
    /// Log-probs `[B · L]` of `targets` after `tokens [B, L]`: one causal forward.
    fn train_logp(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1>;
    /// Caches of `capacity` positions holding `tokens [B, S]` (a prefill).
    fn prefill(&self, tokens: Tensor<B, 2, Int>, capacity: usize) -> Self::Cache;
    /// One decode step: `tokens [B, 1]` appended → log-probs `[B]` of `targets`.
    fn decode(
        &self,
        tokens: Tensor<B, 2, Int>,
        targets: Tensor<B, 1, Int>,
        cache: &mut Self::Cache,
    ) -> Tensor<B, 1>;
}

impl<B: InvariantBackend> Model<B> for Policy<B> {
    type Cache = Vec<burn_invariant::nn::KvCache<B>>;

    fn train_logp(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let [b, l] = tokens.dims();
        let hidden = self.hidden(tokens).expect("hidden");
        let hidden = hidden.reshape([b * l, self.config.d_model]);
        let opts = LinearLogpOptions::default();
        self.head
            .logp(hidden, targets, &opts)
            .expect("InvariantLmHead::logp")
    }

    fn prefill(&self, tokens: Tensor<B, 2, Int>, capacity: usize) -> Self::Cache {
        let [b, s] = tokens.dims();
        let mut caches = self.new_caches(b, capacity);
        self.step(tokens, &mut caches, &vec![s; b])
            .expect("prefill");
        caches
    }

    fn decode(
        &self,
        tokens: Tensor<B, 2, Int>,
        targets: Tensor<B, 1, Int>,
        cache: &mut Self::Cache,
    ) -> Tensor<B, 1> {
        let [b, _] = tokens.dims();
        let hidden = self.step(tokens, cache, &vec![1; b]).expect("decode");
        let opts = LinearLogpOptions::default();
        self.head
            .logp(hidden, targets, &opts)
            .expect("InvariantLmHead::logp")
    }
}

/// Rotary tables as `InvariantAttention` builds them (f64 on the host, rounded to f32), rows
/// `position`, columns `i < head_dim / 2`: `position · θ^(−2i / head_dim)`.
struct Rope {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

impl Rope {
    fn new(head_dim: usize, max_seq_len: usize) -> Self {
        let half = head_dim / 2;
        let angle =
            |p: usize, i: usize| p as f64 * ROPE_THETA.powf(-(2.0 * i as f64) / head_dim as f64);
        let table = |f: fn(f64) -> f64| {
            (0..max_seq_len)
                .flat_map(|p| (0..half).map(move |i| f(angle(p, i)) as f32))
                .collect()
        };
        Self {
            cos: table(f64::cos),
            sin: table(f64::sin),
            half,
        }
    }

    /// `(cos, sin)` of positions `start..start + s`, `[1, 1, s, head_dim / 2]` f32.
    fn at<B: Backend>(&self, start: usize, s: usize, device: &B::Device) -> [Tensor<B, 4>; 2] {
        let rows = |t: &[f32]| {
            let data = t[start * self.half..(start + s) * self.half].to_vec();
            Tensor::from_data(
                TensorData::new(data, [1, 1, s, self.half]),
                (device, DType::F32),
            )
        };
        [rows(&self.cos), rows(&self.sin)]
    }
}

/// Half-split rotary embedding in f32, as `InvariantAttention` computes it (plain tensor ops).
fn rotate<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 4>, sin: &Tensor<B, 4>) -> Tensor<B, 4> {
    let dtype = x.dtype();
    let [b, h, s, d] = x.dims();
    let x = x.cast(DType::F32);
    let x1 = x.clone().slice([0..b, 0..h, 0..s, 0..d / 2]);
    let x2 = x.slice([0..b, 0..h, 0..s, d / 2..d]);
    let first = x1.clone() * cos.clone() - x2.clone() * sin.clone();
    let second = x2 * cos.clone() + x1 * sin.clone();
    Tensor::cat(vec![first, second], 3).cast(dtype)
}

/// `[B, KH, S, Dh]` → `[B, KH·group, S, Dh]`: KV head `g` serves query heads
/// `g·group..(g + 1)·group` (Burn's attention has no GQA).
fn repeat_heads<B: Backend>(kv: Tensor<B, 4>, group: usize) -> Tensor<B, 4> {
    let [b, kh, s, d] = kv.dims();
    kv.unsqueeze_dim::<5>(2)
        .expand([b, kh, group, s, d])
        .reshape([b, kh * group, s, d])
}

/// One layer's KV cache of `BurnPolicy`: every row at the same length. `Option`s so that an
/// append moves the tensor (one handle: `slice_assign` writes in place).
struct BurnCache<B: Backend> {
    key: Option<Tensor<B, 4>>,
    value: Option<Tensor<B, 4>>,
    len: usize,
}

impl<B: Backend> BurnCache<B> {
    fn new(shape: [usize; 4], dtype: DType, device: &B::Device) -> Self {
        Self {
            key: Some(Tensor::zeros(shape, (device, dtype))),
            value: Some(Tensor::zeros(shape, (device, dtype))),
            len: 0,
        }
    }

    /// Appends `k, v [B, KH, S, Dh]` → all keys and values so far.
    fn append(&mut self, k: Tensor<B, 4>, v: Tensor<B, 4>) -> [Tensor<B, 4>; 2] {
        let [b, kh, s, d] = k.dims();
        let (start, end) = (self.len, self.len + s);
        let dst = [0..b, 0..kh, start..end, 0..d];
        let key = self.key.take().expect("cache").slice_assign(dst.clone(), k);
        let value = self.value.take().expect("cache").slice_assign(dst, v);
        self.len = end;
        let seen = [0..b, 0..kh, 0..end, 0..d];
        let out = [key.clone().slice(seen.clone()), value.clone().slice(seen)];
        (self.key, self.value) = (Some(key), Some(value));
        out
    }
}

struct BurnBlock<B: Backend> {
    attn_norm: RmsNorm<B>,
    query: Linear<B>,
    key: Linear<B>,
    value: Linear<B>,
    output: Linear<B>,
    mlp_norm: RmsNorm<B>,
    gate: Linear<B>,
    up: Linear<B>,
    down: Linear<B>,
}

/// The same architecture and weights as [`Policy`], in Burn's own ops.
struct BurnPolicy<B: Backend> {
    embed: Param<Tensor<B, 2>>,
    blocks: Vec<BurnBlock<B>>,
    norm: RmsNorm<B>,
    head: Param<Tensor<B, 2>>,
    config: PolicyConfig,
    rope: Rope,
}

fn burn_linear<B: InvariantBackend>(l: &burn_invariant::nn::InvariantLinear<B>) -> Linear<B> {
    Linear {
        weight: l.weight.clone(),
        bias: None,
    }
}

fn burn_norm<B: InvariantBackend>(n: &burn_invariant::nn::InvariantRmsNorm<B>) -> RmsNorm<B> {
    RmsNorm {
        gamma: n.gamma.clone(),
        epsilon: n.epsilon,
    }
}

impl<B: InvariantBackend> BurnPolicy<B> {
    /// Shares `policy`'s parameters (no copy).
    fn from_policy(policy: &Policy<B>) -> Self {
        let c = policy.config;
        let blocks = policy
            .blocks
            .iter()
            .map(|b| BurnBlock {
                attn_norm: burn_norm(&b.attn_norm),
                query: burn_linear(&b.attn.query),
                key: burn_linear(&b.attn.key),
                value: burn_linear(&b.attn.value),
                output: burn_linear(&b.attn.output),
                mlp_norm: burn_norm(&b.mlp_norm),
                gate: burn_linear(&b.gate),
                up: burn_linear(&b.up),
                down: burn_linear(&b.down),
            })
            .collect();
        Self {
            embed: policy.embed.clone(),
            blocks,
            norm: burn_norm(&policy.norm),
            head: policy.head.weight.clone(),
            config: c,
            rope: Rope::new(c.head_dim, c.max_seq_len),
        }
    }
}

impl<B: Backend> BurnPolicy<B> {
    /// Causal self-attention of `x [B, S, d]` at positions `start..start + S` (every row alike),
    /// over `cache` plus the new tokens where given.
    fn attention(
        &self,
        block: &BurnBlock<B>,
        x: Tensor<B, 3>,
        cache: Option<&mut BurnCache<B>>,
    ) -> Tensor<B, 3> {
        let c = &self.config;
        let [b, s, _] = x.dims();
        let heads = |t: Tensor<B, 3>, n: usize| t.reshape([b, s, n, c.head_dim]).swap_dims(1, 2);
        let q = heads(block.query.forward(x.clone()), c.n_heads);
        let k = heads(block.key.forward(x.clone()), c.n_kv_heads);
        let v = heads(block.value.forward(x), c.n_kv_heads);
        let start = cache.as_ref().map_or(0, |cache| cache.len);
        let [cos, sin] = self.rope.at::<B>(start, s, &q.device());
        let (q, k) = (rotate(q, &cos, &sin), rotate(k, &cos, &sin));
        let [k, v] = match cache {
            Some(cache) => cache.append(k, v),
            None => [k, v],
        };
        let group = c.n_heads / c.n_kv_heads;
        // Several queries only in a prefill (keys = queries): causal; one query sees every key.
        let opts = AttentionModuleOptions {
            is_causal: s > 1,
            ..Default::default()
        };
        let out = burn::tensor::module::attention(
            q,
            repeat_heads(k, group),
            repeat_heads(v, group),
            None,
            None,
            opts,
        );
        let out = out.swap_dims(1, 2).reshape([b, s, c.n_heads * c.head_dim]);
        block.output.forward(out)
    }

    /// Final-normed hidden states `[B, S, d]`, through `caches` (one per layer) where given.
    fn hidden(
        &self,
        tokens: Tensor<B, 2, Int>,
        mut caches: Option<&mut [BurnCache<B>]>,
    ) -> Tensor<B, 3> {
        let mut x = burn::tensor::module::embedding(self.embed.val(), tokens);
        for (l, block) in self.blocks.iter().enumerate() {
            let cache = caches.as_deref_mut().map(|c| &mut c[l]);
            let h = block.attn_norm.forward(x.clone());
            x = x + self.attention(block, h, cache);
            let h = block.mlp_norm.forward(x.clone());
            let mlp = silu(block.gate.forward(h.clone())) * block.up.forward(h);
            x = x + block.down.forward(mlp);
        }
        self.norm.forward(x)
    }

    /// Log-probs of `targets [N]` under `hidden [N, d]`: logits `[N, V]` materialized, f32
    /// `log_softmax`, gather.
    fn head_logp(&self, hidden: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let n = targets.dims()[0];
        let logits = hidden.matmul(self.head.val().transpose()).cast(DType::F32);
        log_softmax(logits, 1)
            .gather(1, targets.reshape([n, 1]))
            .reshape([n])
    }
}

impl<B: Backend> Model<B> for BurnPolicy<B> {
    type Cache = Vec<BurnCache<B>>;

    fn train_logp(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let [b, l] = tokens.dims();
        let hidden = self.hidden(tokens, None);
        self.head_logp(hidden.reshape([b * l, self.config.d_model]), targets)
    }

    /// In chunks of 8 rows (Burn's attention may materialize `[B, H, S, S]` scores), then the
    /// chunks' caches joined.
    fn prefill(&self, tokens: Tensor<B, 2, Int>, capacity: usize) -> Self::Cache {
        let c = &self.config;
        let [b, s] = tokens.dims();
        let (device, dtype) = (tokens.device(), self.head.val().dtype());
        let mut chunks: Vec<Vec<BurnCache<B>>> = Vec::new();
        for start in (0..b).step_by(8) {
            let rows = start..(start + 8).min(b);
            let shape = [rows.len(), c.n_kv_heads, capacity, c.head_dim];
            let mut caches: Vec<BurnCache<B>> = (0..c.n_layers)
                .map(|_| BurnCache::new(shape, dtype, &device))
                .collect();
            self.hidden(tokens.clone().slice([rows, 0..s]), Some(&mut caches[..]));
            chunks.push(caches);
        }
        (0..c.n_layers)
            .map(|l| {
                let join = |f: fn(&BurnCache<B>) -> Tensor<B, 4>| {
                    Tensor::cat(chunks.iter().map(|chunk| f(&chunk[l])).collect(), 0)
                };
                BurnCache {
                    key: Some(join(|c| c.key.clone().expect("cache"))),
                    value: Some(join(|c| c.value.clone().expect("cache"))),
                    len: s,
                }
            })
            .collect()
    }

    fn decode(
        &self,
        tokens: Tensor<B, 2, Int>,
        targets: Tensor<B, 1, Int>,
        cache: &mut Self::Cache,
    ) -> Tensor<B, 1> {
        let [b, _] = tokens.dims();
        let hidden = self.hidden(tokens, Some(&mut cache[..]));
        self.head_logp(hidden.reshape([b, self.config.d_model]), targets)
    }
}

/// The f32 check on NdArray: ours' per-token log-probs for `whole_model.py`, and `BurnPolicy`
/// (trainer, and the last position by prefill + one decode step) against ours.
fn check() {
    type R = burn::backend::NdArray<f32>;
    let s = Sizes::check();
    let device = Default::default();
    let ours = Policy::<R>::hashed(s.policy(), &device, DType::F32).expect("policy");
    let burn = BurnPolicy::from_policy(&ours);
    let (tokens, targets) = train_batch::<R>(&s, &device);
    let logp = host(ours.train_logp(tokens.clone(), targets.clone()));
    let burn_logp = host(burn.train_logp(tokens.clone(), targets.clone()));
    println!("CHECK config {}", s.describe());
    for (i, v) in logp.iter().enumerate() {
        println!("CHECK logp {i} {v:.9e}");
    }
    let max_diff = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    // Decode the last input token over a prefill of the others: its log-prob is the trainer's
    // last position of each row.
    let (b, l) = (s.train_batch, s.train_len);
    let prompt = tokens.clone().slice([0..b, 0..l - 1]);
    let step = tokens.slice([0..b, l - 1..l]);
    let last: Vec<i64> = targets
        .into_data()
        .iter::<i64>()
        .skip(l - 1)
        .step_by(l)
        .collect();
    let trainer_last: Vec<f32> = logp.iter().copied().skip(l - 1).step_by(l).collect();
    let mut cache = ours.prefill(prompt.clone(), l);
    let ours_dec = host(ours.decode(step.clone(), ints1(last.clone(), &device), &mut cache));
    let mut cache = burn.prefill(prompt, l);
    let burn_dec = host(burn.decode(step, ints1(last, &device), &mut cache));
    let bitwise = ours_dec
        .iter()
        .zip(&trainer_last)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    println!(
        "CHECK burn_vs_ours trainer_max_abs_diff={:e} decode_max_abs_diff={:e}; ours decode = trainer bitwise: {bitwise}",
        max_diff(&burn_logp, &logp),
        max_diff(&burn_dec, &trainer_last)
    );
}

/// The timed steps on CUDA.
#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use burn::tensor::backend::AutodiffBackend;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::time::Instant;

    type Inner = burn_cuda::Cuda<half::bf16, i32>;
    type Train = burn::backend::Autodiff<Inner>;

    const PREFILL_TOKENS: u64 = 1001;
    const DECODE_TOKENS: u64 = 1002;
    const DECODE_TARGETS: u64 = 1003;

    fn env_usize(name: &str, default: usize) -> usize {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }

    impl Sizes {
        /// The real layer shapes unless the environment says otherwise.
        fn from_env() -> Self {
            Self {
                layers: env_usize("WM_LAYERS", 4),
                d_model: env_usize("WM_D_MODEL", 4096),
                heads: env_usize("WM_HEADS", 32),
                kv_heads: env_usize("WM_KV_HEADS", 8),
                head_dim: env_usize("WM_HEAD_DIM", 128),
                d_ff: env_usize("WM_D_FF", 14336),
                vocab: env_usize("WM_VOCAB", 128256),
                decode_batch: env_usize("WM_DECODE_BATCH", 64),
                context: env_usize("WM_CONTEXT", 2048),
                train_batch: env_usize("WM_TRAIN_BATCH", 8),
                train_len: env_usize("WM_TRAIN_LEN", 2048),
                warmup: env_usize("WM_WARMUP", 2),
                reps: env_usize("WM_REPS", 7).max(1),
                seed: env_usize("WM_SEED", 7) as u64,
            }
        }
    }

    /// Median milliseconds of `s.reps` device-synced calls of `f`, after `s.warmup`.
    fn median_ms<B: Backend>(s: &Sizes, device: &B::Device, mut f: impl FnMut()) -> f64 {
        for _ in 0..s.warmup {
            f();
            B::sync(device).expect("sync");
        }
        let mut samples: Vec<f64> = (0..s.reps)
            .map(|_| {
                let start = Instant::now();
                f();
                B::sync(device).expect("sync");
                start.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        samples.sort_by(f64::total_cmp);
        samples[samples.len() / 2]
    }

    fn mean(values: &[f32]) -> f64 {
        values.iter().map(|&v| v as f64).sum::<f64>() / values.len().max(1) as f64
    }

    /// The rollout step: `(ms, mean log-prob of the last step)`.
    fn rollout<B: Backend, M: Model<B>>(model: &M, s: &Sizes, device: &B::Device) -> (f64, f64) {
        let (b, ctx) = (s.decode_batch, s.context);
        let prompt = hashed_tokens(s.seed, PREFILL_TOKENS, b * ctx, s.vocab);
        let mut cache = model.prefill(ints2(prompt, [b, ctx], device), s.capacity());
        B::sync(device).expect("sync");
        let tokens = ints2(
            hashed_tokens(s.seed, DECODE_TOKENS, b, s.vocab),
            [b, 1],
            device,
        );
        let targets = ints1(hashed_tokens(s.seed, DECODE_TARGETS, b, s.vocab), device);
        let mut last = None;
        let ms = median_ms::<B>(s, device, || {
            last = Some(model.decode(tokens.clone(), targets.clone(), &mut cache));
        });
        (ms, mean(&host(last.expect("a step"))))
    }

    /// The training step: `(ms, loss of the last step)`.
    fn train<B: AutodiffBackend, M: Model<B>>(
        model: &M,
        s: &Sizes,
        device: &B::Device,
    ) -> (f64, f64) {
        let (tokens, targets) = train_batch::<B>(s, device);
        let mut last = None;
        let ms = median_ms::<B>(s, device, || {
            let loss = model
                .train_logp(tokens.clone(), targets.clone())
                .mean()
                .neg();
            // Every parameter's gradient, dropped at once (no optimizer step).
            let _ = loss.backward();
            last = Some(loss);
        });
        (ms, mean(&host(last.expect("a step"))))
    }

    /// `f()`, or `None` with a `SKIP` line where it panics (out of memory, say).
    fn guarded<T>(name: &str, f: impl FnOnce() -> T) -> Option<T> {
        let out = catch_unwind(AssertUnwindSafe(f));
        if out.is_err() {
            println!("SKIP whole_model {name}: panicked (see above)");
        }
        out.ok()
    }

    /// One variant (`ours` or `burn`) on CUDA bf16: both steps, one `RESULT` line.
    pub fn run(variant: &str) {
        use burn::module::AutodiffModule;
        let s = Sizes::from_env();
        let device = Default::default();
        let start = Instant::now();
        let policy = Policy::<Train>::hashed(s.policy(), &device, DType::BF16).expect("policy");
        Inner::sync(&device).expect("sync");
        println!(
            "INFO whole_model {} params={} init_s={:.1}",
            s.describe(),
            burn::module::Module::num_params(&policy),
            start.elapsed().as_secs_f64()
        );
        let burn = variant == "burn";
        let label = if burn {
            "burn-ops".to_string()
        } else {
            std::env::var("BURN_INVARIANT_IMPL")
                .ok()
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| "default".into())
        };
        let sampler = policy.valid();
        let rolled = guarded(&format!("{variant} rollout"), || {
            if burn {
                rollout::<Inner, _>(&BurnPolicy::from_policy(&sampler), &s, &device)
            } else {
                rollout::<Inner, _>(&sampler, &s, &device)
            }
        });
        fresh_pool(&device);
        let trained = guarded(&format!("{variant} train"), || {
            if burn {
                train::<Train, _>(&BurnPolicy::from_policy(&policy), &s, &device)
            } else {
                train::<Train, _>(&policy, &s, &device)
            }
        });
        let fmt = |x: Option<f64>| x.map_or("NA".into(), |x| format!("{x:.3}"));
        println!(
            "RESULT whole_model {variant} impl={label} rollout_ms={} train_ms={} rollout_mean_logp={} train_loss={}",
            fmt(rolled.map(|r| r.0)),
            fmt(trained.map(|t| t.0)),
            fmt(rolled.map(|r| r.1)),
            fmt(trained.map(|t| t.1))
        );
    }

    /// Syncs and hands the memory pool's free pages back (the training step after the rollout's).
    fn fresh_pool(device: &cubecl::cuda::CudaDevice) {
        use cubecl::Runtime;
        if Inner::sync(device).is_ok() {
            cubecl::cuda::CudaRuntime::client(device).memory_cleanup();
        }
    }
}

/// The whole-model timing; sizes from `WM_*` (see the file's header). `cargo bench` passes
/// `--bench`.
#[derive(clap::Parser)]
struct Args {
    /// `check` (f32 on NdArray), `ours` or `burn` (those two need `--features cuda`).
    #[arg(value_enum)]
    mode: Mode,
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Mode {
    Check,
    Ours,
    Burn,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    match args.mode {
        Mode::Check => check(),
        #[cfg(feature = "cuda")]
        Mode::Ours => gpu::run("ours"),
        #[cfg(feature = "cuda")]
        Mode::Burn => gpu::run("burn"),
        #[cfg(not(feature = "cuda"))]
        Mode::Ours | Mode::Burn => println!("whole_model ours | burn needs --features cuda"),
    }
}
