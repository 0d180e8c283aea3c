//! Train a small LM head (`InvariantLinear` + `InvariantLmHead`, scored by `linear_logp` with
//! padding rows ignored), then
//! show that one sequence's per-token log-probs are bitwise the same scored alone, in a batch
//! of 32 and in chunks — the rollout/trainer agreement RL post-training needs.
//!
//! CPU (NdArray reference) by default: `cargo run --release --example lm_head`.
//! `--features wgpu` or `--features cuda` runs it on that backend.
use burn::module::{AutodiffModule, Module};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::{DType, Int, Tensor, TensorData, backend::AutodiffBackend};
use burn_invariant::{
    InvariantBackend, LinearLogpOptions,
    nn::{InvariantLinear, InvariantLinearConfig, InvariantLmHead, InvariantLmHeadConfig},
    registry::{Op, implementation_for},
};

#[cfg(feature = "cuda")]
type Inner = burn_cuda::Cuda<f32, i32>;
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
type Inner = burn_wgpu::Wgpu<f32, i32>;
#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
type Inner = burn::backend::NdArray<f32>;
type Train = burn::backend::Autodiff<Inner>;

const D_MODEL: usize = 64;
const VOCAB: usize = 1001;
const SEQ: usize = 24;
const BATCH: usize = 32;
const PAD: i64 = -100;

#[derive(Module, Debug)]
struct LmHead<B: InvariantBackend> {
    proj: InvariantLinear<B>,
    /// `[VOCAB, D_MODEL]`.
    unembed: InvariantLmHead<B>,
}

impl<B: InvariantBackend> LmHead<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            proj: InvariantLinearConfig::new(D_MODEL, D_MODEL).init(device),
            unembed: InvariantLmHeadConfig::new(D_MODEL, VOCAB)
                .with_initializer(burn::module::Initializer::Normal {
                    mean: 0.0,
                    std: 0.05,
                })
                .init(device),
        }
    }

    /// Per-token log-probs `[tokens]` of `targets` given features `[tokens, D_MODEL]`.
    fn logp(&self, features: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let hidden = self.proj.forward(features).expect("proj").tanh();
        let options = LinearLogpOptions::default().with_ignore_index(PAD);
        self.unembed
            .logp(hidden, targets, &options)
            .expect("InvariantLmHead::logp")
    }
}

/// Synthetic batch: random features, targets from a fixed hidden rule, padded tails ignored.
fn batch<B: InvariantBackend>(
    seed: u64,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>, usize) {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let tokens = BATCH * SEQ;
    let features: Vec<f32> = (0..tokens * D_MODEL)
        .map(|_| (next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect();
    let mut real = 0;
    let targets: Vec<i64> = (0..tokens)
        .map(|t| {
            let (seq, pos) = (t / SEQ, t % SEQ);
            if pos >= SEQ - seq % 5 {
                return PAD; // right padding of varying length
            }
            real += 1;
            // The target is a function of the features, so the head can learn it.
            let f = &features[t * D_MODEL..(t + 1) * D_MODEL];
            let bucket = f
                .iter()
                .take(8)
                .enumerate()
                .fold(0usize, |acc, (i, x)| acc | (usize::from(*x > 0.0) << i));
            (bucket * 3 % VOCAB) as i64
        })
        .collect();
    (
        Tensor::from_data(
            TensorData::new(features, [tokens, D_MODEL]),
            (device, DType::F32),
        ),
        Tensor::from_data(TensorData::new(targets, [tokens]), device),
        real,
    )
}

fn bits<B: burn::tensor::backend::Backend>(t: Tensor<B, 1>) -> Vec<u32> {
    t.into_data().iter::<f32>().map(f32::to_bits).collect()
}

fn main() {
    let device = Default::default();
    println!(
        "backend: {}",
        <Train as burn::tensor::backend::Backend>::name(&device)
    );
    for op in [Op::Matmul, Op::LinearLogp] {
        match implementation_for::<Train>(op, &device, DType::F32) {
            Ok(imp) => println!("{op:?} runs {imp:?}"),
            Err(err) => println!("{op:?}: {err}"),
        }
    }

    let mut model = LmHead::<Train>::new(&device);
    let mut optim = AdamConfig::new().init();
    for step in 0..8 {
        let (features, targets, real) = batch::<Train>(step, &device);
        let logp = model.logp(features, targets);
        let loss = logp.sum().neg() / real as f64; // ignored rows contribute logp = 0
        println!("step {step}: loss {:.4}", loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-2, model, grads);
    }

    // Scoring: the same sequence alone, in a batch of 32, and in chunks.
    let model = model.valid();
    let (features, targets, _) = batch::<<Train as AutodiffBackend>::InnerBackend>(1234, &device);
    let seq = 7;
    let rows = seq * SEQ..(seq + 1) * SEQ;
    let in_batch = bits(
        model
            .logp(features.clone(), targets.clone())
            .slice(rows.clone()),
    );
    let alone = bits(model.logp(
        features.clone().slice(rows.clone()),
        targets.clone().slice(rows.clone()),
    ));
    let mut chunked = Vec::new();
    for part in [
        rows.start..rows.start + 5,
        rows.start + 5..rows.start + 18,
        rows.start + 18..rows.end,
    ] {
        chunked.extend(bits(model.logp(
            features.clone().slice(part.clone()),
            targets.clone().slice(part),
        )));
    }
    let first: Vec<f32> = in_batch
        .iter()
        .take(4)
        .map(|b| f32::from_bits(*b))
        .collect();
    println!("sequence {seq}: first per-token logprobs {first:?}");
    println!(
        "alone == in batch of {BATCH} (bitwise): {}",
        alone == in_batch
    );
    println!(
        "chunked 5+13+6 == in batch (bitwise): {}",
        chunked == in_batch
    );
    assert!(
        alone == in_batch && chunked == in_batch,
        "batch invariance violated"
    );
}
