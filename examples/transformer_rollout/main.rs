//! A whole transformer policy, rollout and trainer bitwise equal: GRPO on a small Llama-style
//! model (`model.rs`: RMSNorm, GQA attention with RoPE and a KV cache, SwiGLU, the fused
//! LM-head log-prob), every op of it batch-invariant.
//!
//! 1. Rollout: a group of prompts of different lengths is prefilled in one left-padded call
//!    into per-layer KV caches; then one token per call is decoded for the sequences still
//!    running (ragged cache lengths; the batch shrinks as sequences end by EOS or length, the
//!    caches following through `KvCache::select_rows`). Each token is drawn at temperature 0.7
//!    by `linear_sample` in the LM head's one pass (no logits in memory, none on the host), its
//!    noise keyed by (seed, sequence, position): a rerun draws the same tokens, and the
//!    log-prob and entropy it returns are `linear_logp_full`'s for that token.
//! 2. Trainer: the full sequences (prompt + generated) in one right-padded batch, one causal
//!    prefill under `Autodiff`, targets the next tokens with the ignore index on prompt and
//!    padding positions. Every generated token's log-prob and entropy must equal the rollout's,
//!    bitwise (the example exits with an error otherwise). Also: a prompt prefilled in two calls
//!    equals one call.
//! 3. One GRPO step: `−min(r·A, clip(r)·A) − β·H` over the generated tokens, `A` the
//!    group-normalized reward of a fixed rule.
//!
//! CPU (NdArray, f32) by default: `cargo run --release --example transformer_rollout`.
//! `--features cuda` runs it on CUDA in bf16, `--features wgpu` on wgpu in f32.
mod model;

use burn::module::AutodiffModule;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::{DType, Int, Tensor, TensorData, backend::Backend};
use model::{Policy, PolicyConfig, XorShift, padded_tokens, select_rows};

#[cfg(feature = "cuda")]
type Inner = burn_cuda::Cuda<half::bf16, i32>;
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
type Inner = burn_wgpu::Wgpu<f32, i32>;
#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
type Inner = burn::backend::NdArray<f32>;
type Train = burn::backend::Autodiff<Inner>;

#[cfg(feature = "cuda")]
const DTYPE: DType = DType::BF16;
#[cfg(not(feature = "cuda"))]
const DTYPE: DType = DType::F32;

const CONFIG: PolicyConfig = PolicyConfig {
    vocab: 512,
    d_model: 64,
    n_layers: 2,
    n_heads: 4,
    n_kv_heads: 2,
    head_dim: 16,
    d_ff: 128,
    max_seq_len: 64,
    temperature: 0.7,
    ignore_index: IGNORE,
    eos: EOS as usize,
    eos_gain: EOS_GAIN,
    seed: 7,
};
const PROMPT_LENS: [usize; 5] = [9, 4, 13, 6, 2];
const MAX_NEW: usize = 24;
/// A sequence also ends at this many tokens, prompt included.
const MAX_TOTAL: usize = 32;
const PAD: i64 = 0;
const EOS: i64 = 1;
/// The EOS row of the head is scaled by this, so that some responses end by EOS.
const EOS_GAIN: f32 = 1.7;
const IGNORE: i64 = -100;
const BETA: f64 = 0.01;
const CLIP: f64 = 0.2;

fn ints2<B: Backend>(data: Vec<i64>, shape: [usize; 2], device: &B::Device) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(data, shape), device)
}

fn ints1<B: Backend>(data: Vec<i64>, device: &B::Device) -> Tensor<B, 1, Int> {
    let n = data.len();
    Tensor::from_data(TensorData::new(data, [n]), device)
}

/// An f32 tensor on any backend, whatever its float type (bf16 on CUDA here).
fn f32_tensor<B: Backend>(values: Vec<f32>, device: &B::Device) -> Tensor<B, 1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, DType::F32))
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

fn bits<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<u32> {
    host(t).into_iter().map(f32::to_bits).collect()
}

/// The seed of the rollout's draws.
const SAMPLE_SEED: u64 = 2024;

/// The noise key of sequence `s`'s token at position `pos`: unique per (sequence, position).
fn sample_key(s: usize, pos: usize) -> i64 {
    (s * MAX_TOTAL + pos) as i64
}

/// What the rollout produced, per sequence.
struct Rollout {
    prompts: Vec<Vec<i64>>,
    generated: Vec<Vec<i64>>,
    logp: Vec<Vec<f32>>,
    entropy: Vec<Vec<f32>>,
    /// Final-normed hidden state of each prompt's last position after the batched prefill.
    prefill_last: Vec<Vec<u32>>,
    batch_sizes: Vec<usize>,
}

fn rollout(
    policy: &Policy<Inner>,
    prompts: Vec<Vec<i64>>,
    device: &burn::tensor::Device<Inner>,
) -> Rollout {
    let n = prompts.len();
    let width = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let rows: Vec<&[i64]> = prompts.iter().map(Vec::as_slice).collect();
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    // Prefill: all prompts in one left-padded call.
    let mut caches = policy.new_caches(n, MAX_TOTAL);
    let mut hidden = policy
        .step(
            padded_tokens(&rows, width, PAD, true, device),
            &mut caches,
            &lens,
        )
        .expect("prefill");
    let d = CONFIG.d_model;
    let prefill_bits = bits(hidden.clone());
    let prefill_last = (0..n)
        .map(|r| prefill_bits[r * d..(r + 1) * d].to_vec())
        .collect();
    let mut active: Vec<usize> = (0..n).collect(); // the sequence of each cache row
    let (mut generated, mut logp, mut entropy) =
        (vec![vec![]; n], vec![vec![]; n], vec![vec![]; n]);
    let mut batch_sizes = vec![n];
    loop {
        // Draw the next token of every running sequence with its log-prob and entropy.
        let keys: Vec<i64> = active
            .iter()
            .map(|&s| sample_key(s, prompts[s].len() + generated[s].len()))
            .collect();
        let out = policy
            .sample(hidden, ints1(keys, device), SAMPLE_SEED)
            .expect("sample");
        let tokens: Vec<i64> = out.tokens.into_data().iter::<i64>().collect();
        let (lp, ent) = (host(out.logp), host(out.entropy.expect("requested")));
        for (i, &s) in active.iter().enumerate() {
            generated[s].push(tokens[i]);
            logp[s].push(lp[i]);
            entropy[s].push(ent[i]);
        }
        let keep: Vec<usize> = (0..active.len())
            .filter(|&i| {
                let s = active[i];
                let len = generated[s].len();
                tokens[i] != EOS && len < MAX_NEW && prompts[s].len() + len < MAX_TOTAL
            })
            .collect();
        if keep.is_empty() {
            break;
        }
        if keep.len() < active.len() {
            caches = select_rows(&caches, &keep).expect("select_rows");
        }
        let next: Vec<i64> = keep.iter().map(|&i| tokens[i]).collect();
        active = keep.iter().map(|&i| active[i]).collect();
        hidden = policy
            .step(
                ints2(next, [active.len(), 1], device),
                &mut caches,
                &vec![1; active.len()],
            )
            .expect("decode");
        batch_sizes.push(active.len());
    }
    Rollout {
        prompts,
        generated,
        logp,
        entropy,
        prefill_last,
        batch_sizes,
    }
}

/// The trainer's batch: right-padded tokens `[n, width]` and targets `[n · width]`.
fn trainer_batch(r: &Rollout) -> (Vec<i64>, Vec<i64>, usize) {
    let seqs: Vec<Vec<i64>> = r
        .prompts
        .iter()
        .zip(&r.generated)
        .map(|(p, g)| p.iter().chain(g).copied().collect())
        .collect();
    let width = seqs.iter().map(Vec::len).max().unwrap_or(0);
    let mut tokens = Vec::new();
    let mut targets = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        let prompt = r.prompts[s].len();
        for t in 0..width {
            tokens.push(seq.get(t).copied().unwrap_or(PAD));
            // Position t predicts token t + 1: scored where that token was generated.
            let scored = t + 1 >= prompt && t + 1 < seq.len();
            targets.push(if scored { seq[t + 1] } else { IGNORE });
        }
    }
    (tokens, targets, width)
}

fn main() {
    let device = Default::default();
    println!("backend: {}, {DTYPE:?}", <Train as Backend>::name(&device));
    let mut policy = Policy::<Train>::new(CONFIG, &device, DTYPE).expect("policy");
    println!(
        "policy: {} layers, d_model {}, {} query / {} KV heads of {}, SwiGLU {}, vocab {}: {} parameters",
        CONFIG.n_layers,
        CONFIG.d_model,
        CONFIG.n_heads,
        CONFIG.n_kv_heads,
        CONFIG.head_dim,
        CONFIG.d_ff,
        CONFIG.vocab,
        burn::module::Module::num_params(&policy)
    );
    let mut rng = XorShift::new(99);
    let prompts: Vec<Vec<i64>> = PROMPT_LENS
        .iter()
        .map(|&len| {
            (0..len)
                .map(|_| 2 + (rng.next_u64() % (CONFIG.vocab as u64 - 2)) as i64)
                .collect()
        })
        .collect();

    // The rollout worker and the trainer compare fingerprints before they compare any number:
    // equal fingerprints mean the same kernels on the same code (here one process, two backends).
    let rollout_fingerprint = burn_invariant::fingerprint::<Inner>(&device);
    let trainer_fingerprint = burn_invariant::fingerprint::<Train>(&device);
    println!("rollout {rollout_fingerprint}");
    let same_kernels = rollout_fingerprint == trainer_fingerprint;
    println!(
        "trainer fingerprint {}: {}",
        trainer_fingerprint.digest(),
        if same_kernels { "equal" } else { "DIFFERENT" }
    );

    // 1. Rollout on the inner backend (no autodiff), as a sampler would.
    let sampler = policy.valid();
    let r = rollout(&sampler, prompts.clone(), &device);
    let again = rollout(&sampler, prompts, &device);
    let reproducible = again.generated == r.generated;
    let n_gen: usize = r.generated.iter().map(Vec::len).sum();
    let by_eos = r
        .generated
        .iter()
        .filter(|g| g.last() == Some(&EOS))
        .count();
    println!(
        "rollout: {} prompts of lengths {PROMPT_LENS:?} prefilled in one left-padded call, {} decode steps of batch sizes {:?}",
        PROMPT_LENS.len(),
        r.batch_sizes.len() - 1,
        &r.batch_sizes[1..]
    );
    println!(
        "         {n_gen} tokens generated at T = {} ({:?} per sequence, {by_eos} ended by EOS)",
        CONFIG.temperature,
        r.generated.iter().map(Vec::len).collect::<Vec<_>>()
    );
    println!(
        "         a second rollout from the same seed: {}",
        if reproducible {
            "the same tokens"
        } else {
            "OTHER TOKENS"
        }
    );

    // 2. Trainer: one right-padded prefill with gradients.
    let (tokens, targets, width) = trainer_batch(&r);
    let n = r.prompts.len();
    let out = policy
        .trainer(ints2(tokens, [n, width], &device), ints1(targets, &device))
        .expect("trainer");
    let entropy = out.entropy.clone().expect("requested");
    let (t_logp, t_ent) = (bits(out.logp.clone()), bits(entropy.clone()));
    let (mut logp_eq, mut ent_eq) = (0, 0);
    let mut first_diff = None;
    for s in 0..n {
        for (k, (&lp, &ent)) in r.logp[s].iter().zip(&r.entropy[s]).enumerate() {
            let row = s * width + r.prompts[s].len() - 1 + k;
            logp_eq += (t_logp[row] == lp.to_bits()) as usize;
            ent_eq += (t_ent[row] == ent.to_bits()) as usize;
            if (t_logp[row] != lp.to_bits() || t_ent[row] != ent.to_bits()) && first_diff.is_none()
            {
                first_diff = Some(format!(
                    "sequence {s} token {k}: rollout logp {lp:e} entropy {ent:e}, trainer {:e} {:e}",
                    f32::from_bits(t_logp[row]),
                    f32::from_bits(t_ent[row])
                ));
            }
        }
    }
    println!(
        "trainer (one right-padded [{n}, {width}] prefill, Autodiff): {logp_eq} / {n_gen} log-probs and {ent_eq} / {n_gen} entropies bitwise equal to the rollout's"
    );
    if let Some(diff) = &first_diff {
        println!("  first difference: {diff}");
    }

    // Chunked prefill: the longest prompt alone, in two calls, against one call and against
    // the batched prefill; then the first generated token's score.
    let s = (0..n).max_by_key(|&s| r.prompts[s].len()).unwrap_or(0);
    let prompt = &r.prompts[s];
    let cut = prompt.len() / 2;
    let last_hidden = |chunks: &[&[i64]]| {
        let mut caches = sampler.new_caches(1, MAX_TOTAL);
        let mut hidden = None;
        for chunk in chunks {
            let tokens = ints2(chunk.to_vec(), [1, chunk.len()], &device);
            hidden = Some(
                sampler
                    .step(tokens, &mut caches, &[chunk.len()])
                    .expect("prefill"),
            );
        }
        hidden.expect("a chunk")
    };
    let one = last_hidden(&[prompt.as_slice()]);
    let two = last_hidden(&[&prompt[..cut], &prompt[cut..]]);
    let score = |h: Tensor<Inner, 2>| {
        let out = sampler
            .score(h, ints1(vec![r.generated[s][0]], &device))
            .expect("score");
        (bits(out.logp)[0], bits(out.entropy.expect("requested"))[0])
    };
    let chunked_ok = bits(two.clone()) == bits(one.clone())
        && bits(one.clone()) == r.prefill_last[s]
        && score(two) == (r.logp[s][0].to_bits(), r.entropy[s][0].to_bits())
        && score(one) == (r.logp[s][0].to_bits(), r.entropy[s][0].to_bits());
    println!(
        "chunked prefill (prompt {s} alone in {} + {} tokens): last hidden state and first token's logp/entropy bitwise equal to one call and to the batched prefill: {chunked_ok}",
        cut,
        prompt.len() - cut
    );

    // 3. GRPO: rewards of a fixed rule (the share of generated tokens in the lower half of the
    //    vocabulary), group-normalized advantages, clipped ratio, entropy bonus.
    let rewards: Vec<f32> = r
        .generated
        .iter()
        .map(|g| {
            g.iter()
                .filter(|&&t| (t as usize) < CONFIG.vocab / 2)
                .count() as f32
                / g.len() as f32
        })
        .collect();
    let mean = rewards.iter().sum::<f32>() / n as f32;
    let std = (rewards.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / n as f32).sqrt();
    let total = n * width;
    let mut old = vec![0.0f32; total];
    let mut advantage = vec![0.0f32; total];
    let mut mask = vec![0.0f32; total];
    for (s, reward) in rewards.iter().enumerate() {
        for (k, &lp) in r.logp[s].iter().enumerate() {
            let row = s * width + r.prompts[s].len() - 1 + k;
            old[row] = lp;
            advantage[row] = (reward - mean) / (std + 1e-6);
            mask[row] = 1.0;
        }
    }
    let advantage = f32_tensor::<Train>(advantage, &device);
    let mask = f32_tensor::<Train>(mask, &device);
    let ratio = (out.logp - f32_tensor::<Train>(old, &device)).exp();
    let clipped = ratio.clone().clamp(1.0 - CLIP, 1.0 + CLIP);
    let surrogate = (ratio * advantage.clone()).min_pair(clipped * advantage);
    let per_token = surrogate.neg() - entropy.clone().mul_scalar(BETA);
    let loss = (per_token * mask.clone()).sum() / mask.clone().sum();
    let mean_entropy = (entropy * mask.clone()).sum() / mask.sum();
    println!(
        "GRPO: rewards {:?}, loss {:.9}, mean entropy {:.6} nats",
        rewards
            .iter()
            .map(|x| (x * 1000.0).round() / 1000.0)
            .collect::<Vec<_>>(),
        // `host`: the f32 values (`into_scalar` would round to the backend's float type).
        host(loss.clone())[0],
        host(mean_entropy)[0]
    );
    let grads = GradientsParams::from_grads(loss.backward(), &policy);
    let mut optim = AdamConfig::new().init();
    policy = optim.step(1e-3, policy, grads);
    let (tokens, targets, _) = trainer_batch(&r);
    let after = bits(
        policy
            .valid()
            .trainer(ints2(tokens, [n, width], &device), ints1(targets, &device))
            .expect("trainer")
            .logp,
    );
    let moved = (0..total)
        .filter(|&row| targets_scored(&r, width, row) && after[row] != t_logp[row])
        .count();
    println!("after one Adam step: {moved} / {n_gen} log-probs changed");

    if logp_eq != n_gen || ent_eq != n_gen || !chunked_ok || !same_kernels || !reproducible {
        eprintln!("rollout and trainer differ");
        std::process::exit(1);
    }
}

/// Whether trainer row `row` scores a generated token.
fn targets_scored(r: &Rollout, width: usize, row: usize) -> bool {
    let (s, t) = (row / width, row % width);
    let start = r.prompts[s].len() - 1;
    t >= start && t < start + r.generated[s].len()
}
