//! One GRPO-style step with the RL head (`InvariantLmHead::logp_full`, i.e. `linear_logp_full`):
//! temperature and per-token entropy.
//!
//! 1. Rollout: a sampler scores its tokens at temperature 0.7 one decode step at a time, so each
//!    call holds only the sequences still running (ragged batches of varying size).
//! 2. Trainer: the same tokens in one right-padded batch (padding targets = `ignore_index`),
//!    recomputed with gradients. The log-probs are bitwise those of the rollout.
//! 3. Loss: `−min(r·A, clip(r)·A) − β·H` per real token (`r = exp(logp − logp_old)`, `A` the
//!    group-normalized advantage, `H` the entropy), averaged, then one optimizer step.
//!
//! The outputs of `linear_logp_full` are f32 whatever the backend's float type, and Burn does not
//! promote dtypes in binary ops, so the upstream tensors (advantages, masks, old log-probs) are
//! built as f32 explicitly (`f32_tensor`); that is what makes the same code run on a bf16 backend.
//!
//! CPU (NdArray) by default: `cargo run --release --example grpo_step`.
//! `--features cuda` runs it on CUDA in bf16, `--features wgpu` on wgpu in f32.
use burn::module::{AutodiffModule, Initializer, Module};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::{DType, Int, Tensor, TensorData, backend::Backend};
use burn_invariant::{
    InvariantBackend, LinearLogpOptions, LinearLogpOutput,
    nn::{InvariantLinear, InvariantLinearConfig, InvariantLmHead, InvariantLmHeadConfig},
};

#[cfg(feature = "cuda")]
type Inner = burn_cuda::Cuda<half::bf16, i32>;
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
type Inner = burn_wgpu::Wgpu<f32, i32>;
#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
type Inner = burn::backend::NdArray<f32>;
type Train = burn::backend::Autodiff<Inner>;

const D_MODEL: usize = 64;
const VOCAB: usize = 4099;
const GROUP: usize = 8; // responses to one prompt
const MAX_LEN: usize = 24;
const PAD: i64 = -100;
const TEMPERATURE: f64 = 0.7;
const BETA: f64 = 0.01;
const CLIP: f64 = 0.2;

#[derive(Module, Debug)]
struct Policy<B: InvariantBackend> {
    proj: InvariantLinear<B>,
    /// `[VOCAB, D_MODEL]`.
    unembed: InvariantLmHead<B>,
}

impl<B: InvariantBackend> Policy<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            proj: InvariantLinearConfig::new(D_MODEL, D_MODEL).init(device),
            unembed: InvariantLmHeadConfig::new(D_MODEL, VOCAB)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: 0.3,
                })
                .init(device),
        }
    }

    /// The head at the sampling temperature, entropy included, padding rows ignored.
    fn score(&self, features: Tensor<B, 2>, tokens: Tensor<B, 1, Int>) -> LinearLogpOutput<B> {
        let hidden = self.proj.forward(features).expect("proj").tanh();
        let options = LinearLogpOptions::default()
            .with_ignore_index(PAD)
            .with_temperature(TEMPERATURE)
            .with_entropy(true);
        self.unembed
            .logp_full(hidden, tokens, &options)
            .expect("InvariantLmHead::logp_full")
    }
}

/// A small xorshift generator for the rollout's data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// The rollout as the host sees it, in the trainer's padded layout `[GROUP · MAX_LEN]`.
struct Rollout {
    lengths: Vec<usize>,
    features: Vec<f32>,
    tokens: Vec<i64>,
    rewards: Vec<f32>,
}

fn rollout(seed: u64) -> Rollout {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let lengths: Vec<usize> = (0..GROUP)
        .map(|_| 5 + rng.next() as usize % (MAX_LEN - 4))
        .collect();
    let features = (0..GROUP * MAX_LEN * D_MODEL)
        .map(|_| 2.0 * rng.unit() - 1.0)
        .collect();
    let tokens = (0..GROUP * MAX_LEN)
        .map(|row| {
            let pos = row % MAX_LEN;
            if pos < lengths[row / MAX_LEN] {
                (rng.next() % VOCAB as u64) as i64
            } else {
                PAD
            }
        })
        .collect();
    let rewards = (0..GROUP).map(|_| rng.unit()).collect();
    Rollout {
        lengths,
        features,
        tokens,
        rewards,
    }
}

/// An f32 tensor on any backend, whatever its float type (bf16 on CUDA here).
fn f32_tensor<B: Backend>(values: Vec<f32>, device: &B::Device) -> Tensor<B, 1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, DType::F32))
}

/// `rows` of the padded layout as (features, tokens) tensors of backend `B`.
fn rows<B: Backend>(
    r: &Rollout,
    rows: &[usize],
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
    let features: Vec<f32> = rows
        .iter()
        .flat_map(|&row| {
            r.features[row * D_MODEL..(row + 1) * D_MODEL]
                .iter()
                .copied()
        })
        .collect();
    let tokens: Vec<i64> = rows.iter().map(|&row| r.tokens[row]).collect();
    let floats = TensorData::new(features, [rows.len(), D_MODEL]);
    // The features take the backend's float type, as a model's activations would.
    let dtype = Tensor::<B, 1>::zeros([1], device).dtype();
    (
        Tensor::from_data(floats, (device, dtype)),
        Tensor::from_data(TensorData::new(tokens, [rows.len()]), device),
    )
}

fn host(t: Tensor<impl Backend, 1>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

fn main() {
    let device = Default::default();
    <Train as Backend>::seed(&device, 7); // the policy's initial weights
    println!("backend: {}", <Train as Backend>::name(&device));
    let mut policy = Policy::<Train>::new(&device);
    let r = rollout(7);
    let total = GROUP * MAX_LEN;
    let real: Vec<usize> = (0..total).filter(|&row| r.tokens[row] != PAD).collect();

    // 1. Rollout: decode step s scores the sequences still running, one ragged batch per step.
    let sampler = policy.valid();
    let mut old_logp = vec![0.0f32; total];
    let mut batch_sizes = Vec::new();
    for step in 0..MAX_LEN {
        let active: Vec<usize> = (0..GROUP)
            .filter(|&g| r.lengths[g] > step)
            .map(|g| g * MAX_LEN + step)
            .collect();
        if active.is_empty() {
            break;
        }
        let (features, tokens) = rows(&r, &active, &device);
        let logp = host(sampler.score(features, tokens).logp);
        for (&row, value) in active.iter().zip(logp) {
            old_logp[row] = value;
        }
        batch_sizes.push(active.len());
    }
    println!(
        "rollout: {} tokens of {GROUP} responses scored at T = {TEMPERATURE} in {} decode steps, batch sizes {batch_sizes:?}",
        real.len(),
        batch_sizes.len()
    );

    // 2. Trainer: one padded batch with gradients.
    let all: Vec<usize> = (0..total).collect();
    let (features, tokens) = rows(&r, &all, &device);
    let out = policy.score(features, tokens);
    let entropy = out.entropy.expect("entropy was requested");
    let logp = host(out.logp.clone().inner());
    let agree = real
        .iter()
        .filter(|&&row| logp[row].to_bits() == old_logp[row].to_bits())
        .count();
    println!(
        "trainer recompute (one padded batch of {total} rows): {agree} / {} log-probs bitwise equal to the rollout's",
        real.len()
    );

    // 3. GRPO: group-normalized advantages, clipped ratio, entropy bonus, masked mean.
    let mean = r.rewards.iter().sum::<f32>() / GROUP as f32;
    let std = (r.rewards.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / GROUP as f32).sqrt();
    let advantage: Vec<f32> = (0..total)
        .map(|row| (r.rewards[row / MAX_LEN] - mean) / (std + 1e-6))
        .collect();
    let mask: Vec<f32> = (0..total)
        .map(|row| if r.tokens[row] == PAD { 0.0 } else { 1.0 })
        .collect();
    let advantage = f32_tensor::<Train>(advantage, &device);
    let mask = f32_tensor::<Train>(mask, &device);
    let old = f32_tensor::<Train>(old_logp, &device);
    let ratio = (out.logp - old).exp();
    let clipped = ratio.clone().clamp(1.0 - CLIP, 1.0 + CLIP);
    let surrogate = (ratio * advantage.clone()).min_pair(clipped * advantage);
    let per_token = surrogate.neg() - entropy.clone().mul_scalar(BETA);
    let loss = (per_token * mask.clone()).sum() / mask.clone().sum();
    let mean_entropy = (entropy * mask.clone()).sum() / mask.sum();
    println!(
        "loss {:.6}, mean entropy {:.4} nats",
        loss.clone().into_scalar(),
        mean_entropy.into_scalar()
    );
    let grads = GradientsParams::from_grads(loss.backward(), &policy);
    let mut optim = AdamConfig::new().init();
    policy = optim.step(1e-3, policy, grads);

    // After the step, the new policy's log-probs differ from the rollout's: the ratio moves.
    let (features, tokens) = rows(&r, &all, &device);
    let after = host(policy.valid().score(features, tokens).logp);
    let moved = real.iter().filter(|&&row| after[row] != logp[row]).count();
    println!("after one step: {moved} / {} log-probs changed", real.len());
    assert_eq!(agree, real.len(), "rollout and trainer log-probs differ");
}
