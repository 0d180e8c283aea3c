//! `InvariantAttention`: multi-head / grouped-query self-attention with `InvariantLinear`
//! projections, rotary position embeddings and an explicit KV cache, whose every step is
//! batch-invariant: a token's output is the same whether the sequence is decoded one token at a
//! time over the cache, prefilled in one call or in chunks, alone or in a ragged batch.
use std::any::Any;
use std::fmt;
use std::sync::{Arc, Mutex};

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{DType, Int, Tensor, TensorData, backend::Backend};

use super::{InvariantLinear, InvariantLinearConfig};
use crate::{AttentionOptions, InvariantBackend, InvariantError, attention, attention_with_lens};

/// Configuration of an [`InvariantAttention`].
#[derive(Config, Debug)]
pub struct InvariantAttentionConfig {
    /// Model width: input and output features.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (`n_heads % n_kv_heads == 0`; `n_heads` for multi-head attention).
    pub n_kv_heads: usize,
    /// Head size (even: the rotary embedding rotates pairs).
    pub head_dim: usize,
    /// Longest position the rotary tables cover.
    #[config(default = 4096)]
    pub max_seq_len: usize,
    /// Rotary base.
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    /// Whether the projections have a bias.
    #[config(default = false)]
    pub bias: bool,
}

/// Grouped-query self-attention: `q, k, v` projections, rotary embeddings (the half-split
/// layout of Llama), [`crate::attention`], and the output projection.
#[derive(Module, Debug)]
pub struct InvariantAttention<B: InvariantBackend> {
    /// `[d_model, n_heads · head_dim]`.
    pub query: InvariantLinear<B>,
    /// `[d_model, n_kv_heads · head_dim]`.
    pub key: InvariantLinear<B>,
    /// `[d_model, n_kv_heads · head_dim]`.
    pub value: InvariantLinear<B>,
    /// `[n_heads · head_dim, d_model]`.
    pub output: InvariantLinear<B>,
    /// Rotary tables, `cos` and `sin` of `position · θ_i`, each `[max_seq_len, head_dim / 2]`
    /// f32, computed on the host in f64 so every backend holds the same bits.
    #[module(skip)]
    pub rope: RopeTables,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Head size.
    pub head_dim: usize,
}

/// Rotary tables: row `p` holds `cos`/`sin` of `p · θ^(−2i / head_dim)`, computed on the host in
/// f64 and rounded once to f32 (so every backend holds the same bits), uploaded to a device once
/// at its first use there and gathered by position on the device at every call.
#[derive(Clone)]
pub struct RopeTables {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    max_seq_len: usize,
    /// Per backend type and device: `(device, cos, sin)` as `[max_seq_len, half]` f32 tensors.
    uploaded: Arc<Mutex<Vec<Box<dyn Any + Send>>>>,
}

impl fmt::Debug for RopeTables {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RopeTables")
            .field("half", &self.half)
            .field("max_seq_len", &self.max_seq_len)
            .finish_non_exhaustive()
    }
}

/// One device's copy of the tables.
type Uploaded<B> = (burn::tensor::Device<B>, Tensor<B, 2>, Tensor<B, 2>);

impl RopeTables {
    fn new(head_dim: usize, max_seq_len: usize, theta: f64) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(max_seq_len * half);
        let mut sin = Vec::with_capacity(max_seq_len * half);
        for p in 0..max_seq_len {
            for i in 0..half {
                let angle = p as f64 * theta.powf(-(2.0 * i as f64) / head_dim as f64);
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Self {
            cos,
            sin,
            half,
            max_seq_len,
            uploaded: Arc::default(),
        }
    }

    /// The tables on `device`, uploaded at the first call there.
    fn on<B: Backend>(&self, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let mut uploaded = self.uploaded.lock().unwrap_or_else(|e| e.into_inner());
        let found = uploaded.iter().find_map(|entry| {
            entry
                .downcast_ref::<Uploaded<B>>()
                .filter(|(d, _, _)| d == device)
                .map(|(_, cos, sin)| (cos.clone(), sin.clone()))
        });
        found.unwrap_or_else(|| {
            let table = |values: &[f32]| {
                Tensor::<B, 2>::from_data(
                    TensorData::new(values.to_vec(), [self.max_seq_len, self.half]),
                    (device, DType::F32),
                )
            };
            let (cos, sin) = (table(&self.cos), table(&self.sin));
            uploaded.push(Box::new((device.clone(), cos.clone(), sin.clone())));
            (cos, sin)
        })
    }

    /// `(cos, sin)` at `positions` (each clamped into the table), `[rows, head_dim / 2]` f32:
    /// the rows of the device tables, gathered on the device (only the positions are uploaded).
    fn at<B: Backend>(&self, positions: &[usize], device: &B::Device) -> [Tensor<B, 2>; 2] {
        let (cos, sin) = self.on::<B>(device);
        let rows: Vec<i64> = positions
            .iter()
            .map(|&p| p.min(self.max_seq_len.saturating_sub(1)) as i64)
            .collect();
        let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [positions.len()]), device);
        [cos.select(0, rows.clone()), sin.select(0, rows)]
    }
}

impl InvariantAttentionConfig {
    /// Initializes the projections as `InvariantLinearConfig` does, or an error for head
    /// counts or sizes the layer cannot take.
    pub fn init<B: InvariantBackend>(
        &self,
        device: &B::Device,
    ) -> Result<InvariantAttention<B>, InvariantError> {
        let invalid = |reason: String| InvariantError::InvalidArgument {
            arg: "InvariantAttentionConfig",
            reason,
        };
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(invalid(format!(
                "n_kv_heads ({}) must be ≥ 1 and divide n_heads ({})",
                self.n_kv_heads, self.n_heads
            )));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(invalid(format!(
                "head_dim must be even and ≥ 2 (rotary pairs), got {}",
                self.head_dim
            )));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(invalid(format!(
                "rope_theta must be finite and > 0, got {}",
                self.rope_theta
            )));
        }
        let linear = |d_in, d_out| {
            InvariantLinearConfig::new(d_in, d_out)
                .with_bias(self.bias)
                .init(device)
        };
        let (q_width, kv_width) = (
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
        );
        Ok(InvariantAttention {
            query: linear(self.d_model, q_width),
            key: linear(self.d_model, kv_width),
            value: linear(self.d_model, kv_width),
            output: linear(q_width, self.d_model),
            rope: RopeTables::new(self.head_dim, self.max_seq_len, self.rope_theta),
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        })
    }
}

/// The keys and values of every layer position seen so far, per batch row:
/// `[batch, n_kv_heads, capacity, head_dim]` with each row's own length.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    lens: Vec<usize>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `batch` rows of up to `capacity` positions, in `dtype`.
    pub fn new(
        batch: usize,
        n_kv_heads: usize,
        capacity: usize,
        head_dim: usize,
        dtype: DType,
        device: &B::Device,
    ) -> Self {
        let shape = [batch, n_kv_heads, capacity, head_dim];
        Self {
            key: Tensor::zeros(shape, (device, dtype)),
            value: Tensor::zeros(shape, (device, dtype)),
            lens: vec![0; batch],
        }
    }

    /// Positions held by each row.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Positions each row can hold.
    pub fn capacity(&self) -> usize {
        self.key.dims()[2]
    }

    /// The cache of `rows` (in that order): for batches that shrink as sequences end.
    pub fn select_rows(&self, rows: &[usize]) -> Result<Self, InvariantError> {
        if let Some(&bad) = rows.iter().find(|&&r| r >= self.lens.len()) {
            return Err(InvariantError::InvalidArgument {
                arg: "rows",
                reason: format!("row {bad} of a cache of {} rows", self.lens.len()),
            });
        }
        let device = self.key.device();
        let index = Tensor::<B, 1, Int>::from_data(
            TensorData::new(rows.iter().map(|&r| r as i64).collect(), [rows.len()]),
            &device,
        );
        Ok(Self {
            key: self.key.clone().select(0, index.clone()),
            value: self.value.clone().select(0, index),
            lens: rows.iter().map(|&r| self.lens[r]).collect(),
        })
    }

    /// Appends the last `new_lens[b]` of the `S` positions of `key`/`value [batch, n_kv_heads,
    /// S, head_dim]` to row `b` (rows are left-padded: a row's new tokens are its newest).
    fn append(
        &mut self,
        key: Tensor<B, 4>,
        value: Tensor<B, 4>,
        new_lens: &[usize],
    ) -> Result<(), InvariantError> {
        let [batch, heads, s, dim] = key.dims();
        let [_, cache_heads, capacity, cache_dim] = self.key.dims();
        if batch != self.lens.len() || heads != cache_heads || dim != cache_dim {
            return Err(InvariantError::Shape {
                arg: "cache",
                expected: format!(
                    "a cache of {batch} rows, {heads} KV heads of size {dim} (the input's)"
                ),
                got: self.key.dims().to_vec(),
            });
        }
        for (b, (&len, &new)) in self.lens.iter().zip(new_lens).enumerate() {
            if new > s || len + new > capacity {
                return Err(InvariantError::InvalidArgument {
                    arg: "new_lens",
                    reason: format!(
                        "row {b} appends {new} of {s} positions to {len} cached, capacity {capacity}"
                    ),
                });
            }
        }
        // Moved out, not cloned: with a second handle alive, `slice_assign` copies the whole
        // cache (a copy per row and layer made batch-64 decode memory-bound on the copies).
        let mut cache_key = std::mem::replace(&mut self.key, key.clone());
        let mut cache_value = std::mem::replace(&mut self.value, value.clone());
        // Equal lengths and counts (a uniform decode step or prefill): one write for all rows.
        let uniform = self.lens.iter().all(|&l| l == self.lens[0])
            && new_lens.iter().all(|&n| n == new_lens[0]);
        let groups: Vec<(std::ops::Range<usize>, usize)> = if uniform && batch > 0 {
            vec![(0..batch, new_lens[0])]
        } else {
            new_lens
                .iter()
                .enumerate()
                .map(|(b, &n)| (b..b + 1, n))
                .collect()
        };
        for (rows, new) in groups {
            if new == 0 {
                continue;
            }
            let (len, from) = (self.lens[rows.start], s - new);
            let src = [rows.clone(), 0..heads, from..s, 0..dim];
            let dst = [rows.clone(), 0..heads, len..len + new, 0..dim];
            cache_key = cache_key.slice_assign(dst.clone(), key.clone().slice(src.clone()));
            cache_value = cache_value.slice_assign(dst, value.clone().slice(src));
            self.lens[rows].iter_mut().for_each(|l| *l += new);
        }
        self.key = cache_key;
        self.value = cache_value;
        Ok(())
    }
}

impl<B: InvariantBackend> InvariantAttention<B> {
    /// Causal self-attention over whole sequences, `x [batch, seq, d_model]`: token `i` of
    /// every row sits at position `i` (right padding: a padding token never precedes a real one,
    /// so real tokens never see it). The trainer's call.
    pub fn forward(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>, InvariantError> {
        let [batch, seq, _] = x.dims();
        let positions: Vec<usize> = (0..batch).flat_map(|_| 0..seq).collect();
        let [q, k, v] = self.project(x, &positions)?;
        let out = attention(q, k, v, None, &AttentionOptions::default())?;
        self.merge_heads(out)
    }

    /// One step over a KV cache, `x [batch, S, d_model]` left-padded: row `b`'s new tokens
    /// are its last `new_lens[b]` positions; they are appended to the cache and attend to it.
    /// Decode is `S = 1` with `new_lens` all 1; a prompt is prefilled in one or several calls.
    /// Outputs at padding positions are not meaningful (zeros while the row's cache is empty).
    pub fn forward_cached(
        &self,
        x: Tensor<B, 3>,
        cache: &mut KvCache<B>,
        new_lens: &[usize],
    ) -> Result<Tensor<B, 3>, InvariantError> {
        let [batch, seq, _] = x.dims();
        if new_lens.len() != batch {
            return Err(InvariantError::Shape {
                arg: "new_lens",
                expected: format!("one length per row of `x` ({batch})"),
                got: vec![new_lens.len()],
            });
        }
        let positions: Vec<usize> = (0..batch)
            .flat_map(|b| {
                let start =
                    (cache.lens().get(b).copied().unwrap_or(0) + new_lens[b]) as i64 - seq as i64;
                (0..seq as i64).map(move |i| (start + i).max(0) as usize)
            })
            .collect();
        let [q, k, v] = self.project(x, &positions)?;
        cache.append(k, v, new_lens)?;
        // The lengths from the host: no device read per layer and step.
        let out = attention_with_lens(
            q,
            cache.key.clone(),
            cache.value.clone(),
            &cache.lens,
            &AttentionOptions::default(),
        )?;
        self.merge_heads(out)
    }

    /// `q [batch, n_heads, S, head_dim]`, `k`, `v [batch, n_kv_heads, S, head_dim]`, with the
    /// rotary embedding of `positions` (`[batch · S]`) on `q` and `k`.
    fn project(
        &self,
        x: Tensor<B, 3>,
        positions: &[usize],
    ) -> Result<[Tensor<B, 4>; 3], InvariantError> {
        let [batch, seq, _] = x.dims();
        let heads =
            |t: Tensor<B, 3>, n: usize| t.reshape([batch, seq, n, self.head_dim]).swap_dims(1, 2);
        let q = heads(self.query.forward(x.clone())?, self.n_heads);
        let k = heads(self.key.forward(x.clone())?, self.n_kv_heads);
        let v = heads(self.value.forward(x)?, self.n_kv_heads);
        if positions.iter().any(|&p| p >= self.rope.max_seq_len) {
            return Err(InvariantError::InvalidArgument {
                arg: "x",
                reason: format!(
                    "a position past the rotary tables' {} (max_seq_len)",
                    self.rope.max_seq_len
                ),
            });
        }
        let [cos, sin] = self.rope.at::<B>(positions, &q.device());
        let table = |t: Tensor<B, 2>| {
            t.reshape([batch, seq, 1, self.head_dim / 2])
                .swap_dims(1, 2)
        };
        let (cos, sin) = (table(cos), table(sin));
        Ok([rotate(q, &cos, &sin), rotate(k, &cos, &sin), v])
    }

    /// `[batch, n_heads, S, head_dim]` → the output projection of `[batch, S, n_heads · head_dim]`.
    fn merge_heads(&self, out: Tensor<B, 4>) -> Result<Tensor<B, 3>, InvariantError> {
        let [batch, heads, seq, dim] = out.dims();
        self.output
            .forward(out.swap_dims(1, 2).reshape([batch, seq, heads * dim]))
    }
}

/// Rotary embedding, half-split layout, in f32: `(x₁·cos − x₂·sin, x₂·cos + x₁·sin)`, then back
/// to `x`'s dtype. Element-wise, so a token's result depends only on it and its position.
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
