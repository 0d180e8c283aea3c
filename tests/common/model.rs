//! The whole model: the Llama-style policy of `examples/transformer_rollout/model.rs` (embedding,
//! RMSNorm, GQA attention with RoPE and a KV cache, SwiGLU, the fused LM-head log-prob), rollout
//! against trainer, bitwise.
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::tensor::{
    DType, Int, Tensor,
    backend::{AutodiffBackend, Backend},
};
use burn_invariant::InvariantBackend;

use super::{IGNORE, Rng, assert_bits_eq, bits, float, ints};

#[path = "../../examples/transformer_rollout/model.rs"]
mod policy;

use policy::{Policy, PolicyConfig, padded_tokens, select_rows};

const PAD: i64 = 0;

const CONFIG: PolicyConfig = PolicyConfig {
    vocab: 37,
    d_model: 16,
    n_layers: 2,
    n_heads: 4,
    n_kv_heads: 2,
    head_dim: 4,
    d_ff: 24,
    max_seq_len: 16,
    temperature: 0.7,
    ignore_index: IGNORE,
    eos: 1,
    eos_gain: 1.0,
    seed: 3,
};

/// `(prompt length, tokens)`: tokens after the prompt are the "generated" ones, scored.
fn sequences() -> Vec<(usize, Vec<i64>)> {
    let mut rng = Rng::new(41);
    [(3, 8), (5, 7), (1, 6)]
        .into_iter()
        .map(|(prompt, len)| {
            let tokens = (0..len)
                .map(|_| 1 + rng.below(CONFIG.vocab - 1) as i64)
                .collect();
            (prompt, tokens)
        })
        .collect()
}

/// Right-padded tokens `[n, width]` and next-token targets (ignored on prompt positions and
/// padding) of `seqs`, plus `extra` rows of padding only.
fn trainer_batch<B: Backend>(
    seqs: &[(usize, Vec<i64>)],
    extra: usize,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 1, Int>, usize) {
    let width = seqs.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
    let mut rows: Vec<&[i64]> = seqs.iter().map(|(_, s)| s.as_slice()).collect();
    rows.extend(std::iter::repeat_n(&[][..], extra));
    let mut targets = Vec::new();
    for row in 0..rows.len() {
        for t in 0..width {
            let target = match seqs.get(row) {
                Some((prompt, s)) if t + 1 >= *prompt && t + 1 < s.len() => s[t + 1],
                _ => IGNORE,
            };
            targets.push(target);
        }
    }
    (
        padded_tokens(&rows, width, PAD, false, device),
        ints(targets, device),
        width,
    )
}

/// `(logp, entropy)` bits of every scored token, per sequence in order, from trainer outputs
/// over `[n, width]` rows.
fn scored<B: Backend>(
    seqs: &[(usize, Vec<i64>)],
    width: usize,
    logp: Tensor<B, 1>,
    entropy: Tensor<B, 1>,
) -> Vec<(u64, u64)> {
    let (logp, entropy) = (bits(logp), bits(entropy));
    let mut out = Vec::new();
    for (s, (prompt, tokens)) in seqs.iter().enumerate() {
        for t in prompt - 1..tokens.len() - 1 {
            out.push((logp[s * width + t], entropy[s * width + t]));
        }
    }
    out
}

fn compare(what: &str, got: &[(u64, u64)], want: &[(u64, u64)]) {
    let split = |v: &[(u64, u64)]| -> (Vec<u64>, Vec<u64>) { v.iter().copied().unzip() };
    let ((gl, ge), (wl, we)) = (split(got), split(want));
    assert_bits_eq(&format!("{what}: logp"), &gl, &wl);
    assert_bits_eq(&format!("{what}: entropy"), &ge, &we);
}

/// Gradient bits of every float parameter, in visiting order.
struct GradBits<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    out: Vec<(Vec<usize>, Option<Vec<u64>>)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradBits<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        self.out
            .push((t.dims().to_vec(), t.grad(self.grads).map(bits)));
    }
}

/// The Llama-style policy, rollout against trainer, bitwise: the log-probs and entropies of
/// KV-cache decode (a ragged, shrinking batch on the inner backend) = one right-padded trainer
/// prefill under `Autodiff` = each sequence alone = a ragged batch prefilled in chunks; and
/// the gradients of a loss of the trainer's log-probs and entropies w.r.t. every parameter are
/// unchanged by appending sequences of padding only (every target ignored).
pub fn whole_model<B: InvariantBackend + AutodiffBackend>(device: &B::Device, dtype: DType)
where
    B::InnerBackend: InvariantBackend,
{
    let seqs = sequences();
    let n = seqs.len();
    let policy = Policy::<B>::new(CONFIG, device, dtype).expect("policy");
    let sampler = policy.valid();
    let what = format!("whole model {dtype:?}");

    // Trainer: one right-padded prefill.
    let (tokens, targets, width) = trainer_batch::<B>(&seqs, 0, device);
    let out = policy.trainer(tokens, targets.clone()).expect("trainer");
    let entropy = out.entropy.clone().expect("requested");
    let trainer = scored(&seqs, width, out.logp.clone(), entropy.clone());

    // Rollout: prefill the prompts in one left-padded call, then decode one token per call over
    // the sequences still running.
    let mut caches = sampler.new_caches(n, CONFIG.max_seq_len);
    let prompts: Vec<&[i64]> = seqs.iter().map(|(p, s)| &s[..*p]).collect();
    let lens: Vec<usize> = seqs.iter().map(|(p, _)| *p).collect();
    let prompt_width = lens.iter().copied().max().unwrap_or(0);
    let mut hidden = sampler
        .step(
            padded_tokens(&prompts, prompt_width, PAD, true, device),
            &mut caches,
            &lens,
        )
        .expect("prefill");
    let mut pos = lens.iter().map(|p| p - 1).collect::<Vec<_>>(); // of each sequence's hidden
    let mut active: Vec<usize> = (0..n).collect();
    let mut decoded = vec![Vec::new(); n];
    loop {
        let next: Vec<i64> = active.iter().map(|&s| seqs[s].1[pos[s] + 1]).collect();
        let out = sampler
            .score(hidden, ints(next.clone(), device))
            .expect("score");
        let (lp, ent) = (bits(out.logp), bits(out.entropy.expect("requested")));
        for (i, &s) in active.iter().enumerate() {
            decoded[s].push((lp[i], ent[i]));
        }
        let keep: Vec<usize> = (0..active.len())
            .filter(|&i| pos[active[i]] + 2 < seqs[active[i]].1.len())
            .collect();
        if keep.is_empty() {
            break;
        }
        caches = select_rows(&caches, &keep).expect("select_rows");
        let tokens: Vec<i64> = keep.iter().map(|&i| next[i]).collect();
        active = keep.iter().map(|&i| active[i]).collect();
        for &s in &active {
            pos[s] += 1;
        }
        let tokens = Tensor::from_data(
            burn::tensor::TensorData::new(tokens, [active.len(), 1]),
            device,
        );
        hidden = sampler
            .step(tokens, &mut caches, &vec![1; active.len()])
            .expect("decode");
    }
    let decoded: Vec<(u64, u64)> = decoded.into_iter().flatten().collect();
    compare(&format!("{what}: decode vs trainer"), &decoded, &trainer);

    // Each sequence alone through the trainer.
    let mut alone = Vec::new();
    for seq in &seqs {
        let one = std::slice::from_ref(seq);
        let (tokens, targets, width) = trainer_batch::<B>(one, 0, device);
        let out = policy.trainer(tokens, targets).expect("trainer alone");
        alone.extend(scored(
            one,
            width,
            out.logp,
            out.entropy.expect("requested"),
        ));
    }
    compare(&format!("{what}: alone vs batch"), &alone, &trainer);

    // A ragged batch prefilled in two chunks over the caches (sequence 2's first chunk empty),
    // every position scored against its next token.
    let cuts = [2, 4, 0];
    let mut caches = sampler.new_caches(n, CONFIG.max_seq_len);
    let mut per_row: Vec<Vec<Tensor<B::InnerBackend, 2>>> = vec![Vec::new(); n];
    for chunk in 0..2 {
        let parts: Vec<&[i64]> = seqs
            .iter()
            .zip(cuts)
            .map(|((_, s), cut)| {
                let body = &s[..s.len() - 1];
                if chunk == 0 {
                    &body[..cut]
                } else {
                    &body[cut..]
                }
            })
            .collect();
        let new_lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        let s = new_lens.iter().copied().max().unwrap_or(0);
        let hidden = sampler
            .hidden_cached(
                padded_tokens(&parts, s, PAD, true, device),
                &mut caches,
                &new_lens,
            )
            .expect("chunked prefill");
        for (b, &new) in new_lens.iter().enumerate().filter(|(_, new)| **new > 0) {
            let rows = hidden
                .clone()
                .slice([b..b + 1, s - new..s, 0..CONFIG.d_model]);
            per_row[b].push(rows.reshape([new, CONFIG.d_model]));
        }
    }
    let hidden = Tensor::cat(per_row.into_iter().flatten().collect(), 0);
    let (_, chunk_targets, _) = trainer_batch::<B::InnerBackend>(&seqs, 0, device);
    // The trainer's targets restricted to each sequence's real positions (all but its last).
    let keep: Vec<i64> = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, (_, t))| (0..t.len() - 1).map(move |i| (s * width + i) as i64))
        .collect();
    let chunk_targets = chunk_targets.select(0, ints(keep, device));
    let out = sampler.score(hidden, chunk_targets).expect("score");
    let (lp, ent) = (bits(out.logp), bits(out.entropy.expect("requested")));
    let mut chunked = Vec::new();
    let mut row = 0;
    for (prompt, tokens) in &seqs {
        for t in 0..tokens.len() - 1 {
            if t + 1 >= *prompt {
                chunked.push((lp[row], ent[row]));
            }
            row += 1;
        }
    }
    compare(
        &format!("{what}: chunked ragged prefill vs trainer"),
        &chunked,
        &trainer,
    );

    // Gradients: the padded batch against the same batch with sequences of padding appended.
    let grads = |extra: usize| {
        let (tokens, targets, width) = trainer_batch::<B>(&seqs, extra, device);
        let rows = (n + extra) * width;
        let mut rng = Rng::new(77);
        let coef = |rng: &mut Rng| -> Vec<f32> {
            (0..rows)
                .map(|r| if r < n * width { rng.uniform() } else { 0.0 })
                .collect()
        };
        let (a, c) = (coef(&mut rng), coef(&mut rng));
        let out = policy.trainer(tokens, targets).expect("trainer");
        let loss = (out.logp * float::<B, 1>(a, [rows], device, DType::F32)).sum()
            + (out.entropy.expect("requested") * float::<B, 1>(c, [rows], device, DType::F32))
                .sum();
        let grads = loss.backward();
        let mut visitor = GradBits::<B> {
            grads: &grads,
            out: Vec::new(),
        };
        policy.visit(&mut visitor);
        visitor.out
    };
    let base = grads(0);
    let padded = grads(2);
    assert_eq!(
        base.len(),
        3 + 9 * CONFIG.n_layers,
        "{what}: parameter count"
    );
    for (i, ((shape, g), (_, p))) in base.iter().zip(&padded).enumerate() {
        let g = g
            .as_ref()
            .unwrap_or_else(|| panic!("{what}: parameter {i} has no gradient"));
        let p = p.as_ref().expect("padded gradient");
        assert_bits_eq(
            &format!("{what}: gradient of parameter {i} {shape:?} with padding sequences"),
            p,
            g,
        );
    }
}
