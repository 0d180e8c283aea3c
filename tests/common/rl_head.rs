//! The RL head of `linear_logp_full` (temperature and entropy), generic over backends: values
//! against f64, the invariance contract, gradients against an analytic f64 computation, and
//! the errors for bad temperatures.
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};
use burn_invariant::{InvariantBackend, InvariantError, LinearLogpOutput};

use super::{
    IGNORE, Logp, LogpGrads, Rng, assert_bits_eq, bits, chunks, float, ints, logp_problem, rows_of,
    unit_roundoff, values,
};

/// The temperatures of the test matrix.
pub const TEMPERATURES: [f64; 4] = [0.3, 0.7, 1.0, 1.7];

/// `(logp, lse, entropy, z)` of one row in f64 at temperature `t`: `z = (h·w + b) / t`. Ignored
/// rows (and targets outside `[0, V)`) give `logp = 0`; the entropy is computed for every row.
pub fn head_row_f64(
    h: &[f64],
    w: &[f64],
    b: Option<&[f64]>,
    target: i64,
    t: f64,
    [d, v]: [usize; 2],
) -> (f64, f64, f64, Vec<f64>) {
    let z: Vec<f64> = (0..v)
        .map(|j| {
            let dot = (0..d).map(|k| h[k] * w[j * d + k]).sum::<f64>();
            (dot + b.map_or(0.0, |b| b[j])) / t
        })
        .collect();
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sum = z.iter().map(|x| (x - max).exp()).sum::<f64>();
    let lse = max + sum.ln();
    let mean_z = z.iter().map(|x| (x - lse).exp() * x).sum::<f64>();
    let logp = if (0..v as i64).contains(&target) {
        z[target as usize] - lse
    } else {
        0.0
    };
    (logp, lse, lse - mean_z, z)
}

impl<B: InvariantBackend> Logp<B> {
    /// `linear_logp_full` with this problem's options.
    pub fn run_full(&self) -> LinearLogpOutput<B> {
        burn_invariant::linear_logp_full(
            self.hidden.clone(),
            self.weight.clone(),
            self.targets.clone(),
            self.bias.clone(),
            &self.options,
        )
        .expect("linear_logp_full")
    }
}

/// The problem with the RL head's options: temperature `t`, entropy on.
fn head_problem<B: InvariantBackend>(
    device: &B::Device,
    dtype: DType,
    shape: [usize; 3],
    with_bias: bool,
    t: f64,
    seed: u64,
) -> Logp<B> {
    let mut p = logp_problem::<B>(device, dtype, shape, with_bias, Some(3), seed);
    p.options = p.options.clone().with_temperature(t).with_entropy(true);
    p
}

/// `(logp, lse, entropy)` bits of one `linear_logp_full` call.
fn head_bits<B: InvariantBackend>(out: LinearLogpOutput<B>) -> [Vec<u64>; 3] {
    let entropy = out.entropy.expect("entropy was requested");
    [bits(out.logp), bits(out.lse), bits(entropy)]
}

/// logp, lse and entropy against f64 at every temperature, on shapes that are no multiple of any
/// tile (V prime, N = 1), with bias and `ignore_index`; and the head's own guarantees: entropy
/// `Some` iff requested, logp / lse bitwise those of `linear_logp_with_lse`, temperature 1
/// bitwise the default call, ignored rows with `entropy = 0`.
pub fn head_correctness<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let shapes = [[1, 7, 13], [5, 33, 1009], [13, 67, 251], [4, 9, 4099]];
    for (s, shape) in shapes.into_iter().enumerate() {
        for (k, &t) in TEMPERATURES.iter().enumerate() {
            let with_bias = (s + k) % 2 == 0;
            let p = head_problem::<B>(device, dtype, shape, with_bias, t, 300 + s as u64);
            let what = format!("linear_logp_full {dtype:?} {shape:?} T={t} bias={with_bias}");
            let out = p.run_full();
            let [logp, lse, entropy] =
                [out.logp, out.lse, out.entropy.expect("entropy")].map(values);
            let (h, w) = (values(p.hidden.clone()), values(p.weight.clone()));
            let b = p.bias.clone().map(values);
            let [n, d, v] = shape;
            for i in 0..n {
                let target = p.target_values[i];
                let (el, ee, eh, z) =
                    head_row_f64(&h[i * d..(i + 1) * d], &w, b.as_deref(), target, t, [d, v]);
                // The f32 logit error (that of the untempered dot product, divided by T), and
                // the f32 rounding of exp / log / the sums over V terms.
                let zmax = z.iter().fold(0.0f64, |a, x| a.max(x.abs()));
                let tol = 1e-5 * (1.0 + zmax) * (d as f64).sqrt().max(1.0)
                    + 2e-6 * (v as f64).ln().max(1.0);
                assert!(
                    (lse[i] - ee).abs() <= tol,
                    "{what}: lse[{i}] {} vs {ee}, tol {tol:e}",
                    lse[i]
                );
                if target == IGNORE {
                    assert_eq!(logp[i], 0.0, "{what}: ignored row {i} logp");
                    assert_eq!(entropy[i], 0.0, "{what}: ignored row {i} entropy");
                } else {
                    assert!(
                        (logp[i] - el).abs() <= 2.0 * tol,
                        "{what}: logp[{i}] {} vs {el}, tol {tol:e}",
                        logp[i]
                    );
                    assert!(
                        (entropy[i] - eh).abs() <= 4.0 * tol,
                        "{what}: entropy[{i}] {} vs {eh}, tol {tol:e}",
                        entropy[i]
                    );
                }
            }
            // logp and lse do not depend on whether the entropy is computed, to the last bit.
            let (l2, e2) = p.run();
            let full = head_bits(p.run_full());
            for (name, plain, with) in [("logp", l2, &full[0]), ("lse", e2, &full[1])] {
                assert_bits_eq(
                    &format!("{what}: {name} without entropy"),
                    &bits(plain),
                    with,
                );
            }
            let mut plain = p.select(&(0..n).collect::<Vec<_>>());
            plain.options = plain.options.clone().with_entropy(false);
            assert!(
                plain.run_full().entropy.is_none(),
                "{what}: entropy not requested"
            );
        }
    }
    // The temperature scales the logits exactly once: T = 0.5 on (W, b) is bitwise T = 1 on
    // (2W, 2b), since doubling is exact in every dtype and commutes with each rounding.
    let p = head_problem::<B>(device, dtype, [6, 17, 300], true, 0.5, 333);
    let mut doubled = p.select(&(0..p.n).collect::<Vec<_>>());
    doubled.weight = p.weight.clone() * 2.0;
    doubled.bias = p.bias.clone().map(|b| b * 2.0);
    doubled.options = p.options.clone().with_temperature(1.0);
    let (half_t, double_w) = (head_bits(p.run_full()), head_bits(doubled.run_full()));
    for (c, name) in ["logp", "lse", "entropy"].iter().enumerate() {
        assert_bits_eq(
            &format!("{dtype:?}: {name} at T = 0.5 vs T = 1 with 2W, 2b"),
            &half_t[c],
            &double_w[c],
        );
    }
}

/// Masked vocabulary (−∞ bias entries): logp, lse and entropy stay finite, and every gradient
/// is finite with exactly zero `dBias` on the masked columns, also where the entropy is
/// differentiated (`p = 0` there, where `z − lse` is −∞).
pub fn head_masked_vocabulary<B: AutodiffBackend + InvariantBackend>(
    device: &B::Device,
    dtype: DType,
) {
    let mut p = head_problem::<B>(device, dtype, [5, 11, 97], true, 0.7, 391);
    let masked = [0usize, 13, 96];
    let mut bias = values(p.bias.clone().expect("bias"));
    for &j in &masked {
        bias[j] = f64::NEG_INFINITY;
    }
    let bias: Vec<f32> = bias.iter().map(|&x| x as f32).collect();
    p.bias = Some(float::<B, 1>(bias, [p.v], device, dtype));
    // No target on a masked column (its logp would be −∞ by definition).
    let targets: Vec<i64> = p
        .target_values
        .iter()
        .map(|&t| if masked.contains(&(t as usize)) { 1 } else { t })
        .collect();
    p.targets = ints::<B>(targets.clone(), device);
    p.target_values = targets;
    let out = p.run_full();
    let what = format!("linear_logp_full {dtype:?} with −∞ bias");
    for (name, t) in [
        ("logp", out.logp),
        ("lse", out.lse),
        ("entropy", out.entropy.expect("entropy")),
    ] {
        assert!(
            values(t).iter().all(|x| x.is_finite()),
            "{what}: {name} finite"
        );
    }
    let g = [1.0f32, 0.5, 0.3].map(|x| Tensor::<B, 1>::full([p.n], x, (device, DType::F32)));
    let grads = head_grads(&p, [&g[0], &g[1], &g[2]]);
    let db = values(grads.bias.expect("bias grad"));
    for (name, got) in [
        ("dHidden", values(grads.hidden)),
        ("dWeight", values(grads.weight)),
        ("dBias", db.clone()),
    ] {
        assert!(got.iter().all(|x| x.is_finite()), "{what}: {name} finite");
    }
    for &j in &masked {
        assert_eq!(db[j], 0.0, "{what}: dBias of masked column {j}");
    }
}

/// Unchecked targets (`skip_target_check`) outside `[0, V)`, −1 among them, give NaN logp on every
/// implementation (never another class, never an ignored row), and their entropy as any row's;
/// ignored rows give 0 for both.
pub fn unchecked_targets_give_nan<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let mut p = head_problem::<B>(device, dtype, [6, 9, 31], false, 0.7, 395);
    let targets = vec![0, 31, -1, 3, IGNORE, i32::MAX as i64];
    p.targets = ints::<B>(targets.clone(), device);
    p.target_values = targets;
    p.options = p.options.clone().with_skip_target_check(true);
    let out = p.run_full();
    let (logp, entropy) = (values(out.logp), values(out.entropy.expect("entropy")));
    let what = format!("{dtype:?} unchecked targets");
    for i in [1, 2, 5] {
        assert!(
            logp[i].is_nan(),
            "{what}: logp[{i}] = {} is not NaN",
            logp[i]
        );
        assert!(
            entropy[i].is_finite() && entropy[i] > 0.0,
            "{what}: entropy[{i}]"
        );
    }
    assert!(
        logp[0].is_finite() && logp[3].is_finite(),
        "{what}: {logp:?}"
    );
    assert_eq!((logp[4], entropy[4]), (0.0, 0.0), "{what}: ignored row");
}

/// The invariance contract for the head at T = 0.7 with entropy: a row alone, in a batch,
/// chunked, padded and rerun give the same bits of logp, lse and entropy.
pub fn head_row_invariance<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    for (s, shape) in [[29, 37, 613], [9, 16, 4099]].into_iter().enumerate() {
        let p = head_problem::<B>(device, dtype, shape, s == 0, 0.7, 340 + s as u64);
        let what = format!("linear_logp_full {dtype:?} {shape:?}");
        let full = head_bits(p.run_full());
        let names = ["logp", "lse", "entropy"];
        for row in [0, p.n / 2, p.n - 1] {
            let alone = head_bits(p.select(&[row]).run_full());
            for c in 0..3 {
                assert_bits_eq(
                    &format!("{what}: {} row {row} alone", names[c]),
                    &alone[c],
                    &full[c][row..row + 1],
                );
            }
        }
        let mut chunked: [Vec<u64>; 3] = Default::default();
        for range in chunks(p.n, &[2, 3, 7]) {
            let part = head_bits(p.select(&range.collect::<Vec<_>>()).run_full());
            for c in 0..3 {
                chunked[c].extend(&part[c]);
            }
        }
        let mut padded = p.padded(11, 341);
        padded.options = p.options.clone();
        let padded = head_bits(padded.run_full());
        for c in 0..3 {
            assert_bits_eq(
                &format!("{what}: {} chunked", names[c]),
                &chunked[c],
                &full[c],
            );
            assert_bits_eq(
                &format!("{what}: {} padded", names[c]),
                &padded[c][..p.n],
                &full[c],
            );
        }
        for _ in 0..3 {
            let again = head_bits(p.run_full());
            for c in 0..3 {
                assert_bits_eq(&format!("{what}: {} rerun", names[c]), &again[c], &full[c]);
            }
        }
    }
}

/// Gradients of `Σ_i g_logp_i·logp_i + g_lse_i·lse_i + g_ent_i·entropy_i`.
pub fn head_grads<B: AutodiffBackend + InvariantBackend>(
    p: &Logp<B>,
    [g_logp, g_lse, g_ent]: [&Tensor<B, 1>; 3],
) -> LogpGrads<B::InnerBackend> {
    let hidden = p.hidden.clone().require_grad();
    let weight = p.weight.clone().require_grad();
    let bias = p.bias.clone().map(|b| b.require_grad());
    let out = burn_invariant::linear_logp_full(
        hidden.clone(),
        weight.clone(),
        p.targets.clone(),
        bias.clone(),
        &p.options,
    )
    .expect("linear_logp_full");
    let entropy = out.entropy.expect("entropy");
    let loss = out.logp * g_logp.clone() + out.lse * g_lse.clone() + entropy * g_ent.clone();
    let grads = loss.sum().backward();
    LogpGrads {
        hidden: hidden.grad(&grads).expect("hidden grad"),
        weight: weight.grad(&grads).expect("weight grad"),
        bias: bias.map(|b| b.grad(&grads).expect("bias grad")),
    }
}

/// Gradients of `α·logp + β·entropy + γ·lse` (per-row α, β, γ) into hidden, weight and bias
/// against f64: `∂L/∂z_j = α(1[j=t] − p_j) + γ·p_j − β·p_j(z_j − lse + H)`, times `1/T` onto the
/// logits; ignored rows without the α and β parts.
pub fn head_gradients_f64<B: AutodiffBackend + InvariantBackend>(
    device: &B::Device,
    dtype: DType,
    shape: [usize; 3],
) {
    for &t in &[0.7, 1.7] {
        let p = head_problem::<B>(device, dtype, shape, true, t, 361);
        let [n, d, v] = shape;
        let mut rng = Rng::new(362);
        let (ga, gb, gc) = (rng.vec(n, 1.0), rng.vec(n, 0.5), rng.vec(n, 0.3));
        let g = |x: &Vec<f32>| float::<B, 1>(x.clone(), [n], device, DType::F32);
        let grads = head_grads(&p, [&g(&ga), &g(&gc), &g(&gb)]);
        let (h, w, b) = (
            values(p.hidden.clone()),
            values(p.weight.clone()),
            values(p.bias.clone().expect("bias")),
        );
        let mut dl = vec![0.0f64; n * v];
        for i in 0..n {
            let target = p.target_values[i];
            let (_, lse, ent, z) =
                head_row_f64(&h[i * d..(i + 1) * d], &w, Some(&b), target, t, [d, v]);
            let ignored = target == IGNORE;
            let alpha = if ignored { 0.0 } else { ga[i] as f64 };
            let beta = if ignored { 0.0 } else { gb[i] as f64 };
            let gamma = gc[i] as f64;
            for j in 0..v {
                let prob = (z[j] - lse).exp();
                let one_hot = if target == j as i64 { 1.0 } else { 0.0 };
                let dz = alpha * (one_hot - prob) + gamma * prob - beta * prob * (z[j] - lse + ent);
                dl[i * v + j] = dz / t;
            }
        }
        let what = format!("linear_logp_full grads {dtype:?} {shape:?} T={t}");
        let check = |name: &str, got: &[f64], exact: &[f64], scale: &[f64]| {
            for (idx, ((g, e), s)) in got.iter().zip(exact).zip(scale).enumerate() {
                let tol = 2e-4 * (1.0 + s) + 2.0 * unit_roundoff(dtype) * (s + e.abs());
                assert!(
                    (g - e).abs() <= tol,
                    "{what}: {name}[{idx}] {g} vs {e}, tol {tol:e}"
                );
            }
        };
        let (mut eh, mut sh) = (vec![0.0; n * d], vec![0.0; n * d]);
        let (mut ew, mut sw) = (vec![0.0; v * d], vec![0.0; v * d]);
        let (mut eb, mut sb) = (vec![0.0; v], vec![0.0; v]);
        for i in 0..n {
            for j in 0..v {
                let x = dl[i * v + j];
                eb[j] += x;
                sb[j] += x.abs();
                for k in 0..d {
                    eh[i * d + k] += x * w[j * d + k];
                    sh[i * d + k] += (x * w[j * d + k]).abs();
                    ew[j * d + k] += x * h[i * d + k];
                    sw[j * d + k] += (x * h[i * d + k]).abs();
                }
            }
        }
        check("dHidden", &values(grads.hidden), &eh, &sh);
        check("dWeight", &values(grads.weight), &ew, &sw);
        check("dBias", &values(grads.bias.expect("bias")), &eb, &sb);
    }
}

/// The backward invariance contract with entropy: `dHidden` rows alone / chunked equal the batch
/// bitwise; `dWeight` and `dBias` unchanged by appended rows with zero upstream gradients; rerun.
pub fn head_backward_invariance<B: AutodiffBackend + InvariantBackend>(
    device: &B::Device,
    dtype: DType,
) {
    let p = head_problem::<B>(device, dtype, [21, 45, 613], true, 0.7, 371);
    let mut rng = Rng::new(372);
    let n = p.n;
    let g: [Tensor<B, 1>; 3] =
        [1.0, 0.2, 0.5].map(|s| float::<B, 1>(rng.vec(n, s), [n], device, DType::F32));
    let what = format!("linear_logp_full backward {dtype:?}");
    let full = head_grads(&p, [&g[0], &g[1], &g[2]]);
    let dh = bits(full.hidden.clone());
    let dw = bits(full.weight.clone());
    let db = bits(full.bias.clone().expect("bias"));
    let select1 = |t: &Tensor<B, 1>, rows: &[usize]| {
        t.clone().select(
            0,
            ints::<B>(rows.iter().map(|&r| r as i64).collect(), device),
        )
    };
    for range in chunks(n, &[1, 2, 11]) {
        let rows: Vec<usize> = range.clone().collect();
        let gs = g.clone().map(|t| select1(&t, &rows));
        let part = head_grads(&p.select(&rows), [&gs[0], &gs[1], &gs[2]]);
        assert_bits_eq(
            &format!("{what}: dHidden rows {range:?}"),
            &bits(part.hidden),
            &rows_of(&dh, p.d, range),
        );
    }
    let mut padded = p.padded(9, 373);
    padded.options = p.options.clone();
    let zeros = Tensor::<B, 1>::zeros([9], (device, DType::F32));
    let gp = g.clone().map(|t| Tensor::cat(vec![t, zeros.clone()], 0));
    let pg = head_grads(&padded, [&gp[0], &gp[1], &gp[2]]);
    assert_bits_eq(&format!("{what}: dWeight padded"), &bits(pg.weight), &dw);
    assert_bits_eq(
        &format!("{what}: dBias padded"),
        &bits(pg.bias.expect("bias")),
        &db,
    );
    assert_bits_eq(
        &format!("{what}: dHidden padded"),
        &bits(pg.hidden)[..n * p.d],
        &dh,
    );
    let again = head_grads(&p, [&g[0], &g[1], &g[2]]);
    assert_bits_eq(&format!("{what}: rerun dHidden"), &bits(again.hidden), &dh);
    assert_bits_eq(&format!("{what}: rerun dWeight"), &bits(again.weight), &dw);
}

/// A temperature that is not finite and positive (or whose inverse is no normal f32) is an
/// `InvalidArgument` naming `temperature`, from every entry point, before anything runs.
pub fn bad_temperature<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let p = logp_problem::<B>(device, dtype, [3, 5, 7], false, None, 381);
    for t in [
        0.0,
        -0.5,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        1e-300,
        1e300,
    ] {
        let opts = p.options.clone().with_temperature(t).with_entropy(true);
        let call = || {
            (
                p.hidden.clone(),
                p.weight.clone(),
                p.targets.clone(),
                p.bias.clone(),
            )
        };
        let (h, w, tg, b) = call();
        let full = burn_invariant::linear_logp_full(h, w, tg, b, &opts).map(|_| ());
        let (h, w, tg, b) = call();
        let plain = burn_invariant::linear_logp(h, w, tg, b, &opts).map(|_| ());
        for (name, result) in [("linear_logp_full", full), ("linear_logp", plain)] {
            match result {
                Err(InvariantError::InvalidArgument { arg, .. }) => {
                    assert_eq!(arg, "temperature", "{name} T={t}")
                }
                other => {
                    panic!("{name} with temperature {t}: expected InvalidArgument, got {other:?}")
                }
            }
        }
    }
}
