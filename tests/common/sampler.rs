//! `linear_sample`, generic over backends: the drawn token's `logp`, `lse` and entropy bitwise
//! those of `linear_logp_full`, row invariance (alone = in a batch = chunked = reordered =
//! rerun), greedy = argmax, the distribution against the exact softmax, and the errors.
use burn::tensor::{DType, Int, Tensor};
use burn_invariant::{InvariantBackend, InvariantError, LinearSampleOutput, SampleOptions};

use super::{Logp, assert_bits_eq, bits, chunks, float, ints, logp_problem, values};

/// The option sets every check runs: plain, tempered with entropy, greedy, top-1, top-5, top-64.
pub fn option_sets() -> Vec<SampleOptions> {
    let base = SampleOptions::default().with_seed(0x5eed_0000_0001);
    vec![
        base.clone(),
        base.clone().with_temperature(0.7).with_entropy(true),
        base.clone().with_greedy(true).with_temperature(1.3),
        base.clone().with_top_k(1),
        base.clone().with_top_k(5).with_temperature(0.9),
        base.with_top_k(64).with_temperature(1.7).with_entropy(true),
    ]
}

/// `linear_sample` on `p` with row keys `keys`.
pub fn sample<B: InvariantBackend>(
    p: &Logp<B>,
    hidden: Tensor<B, 2>,
    keys: Tensor<B, 1, Int>,
    options: &SampleOptions,
) -> LinearSampleOutput<B> {
    burn_invariant::linear_sample(hidden, p.weight.clone(), keys, p.bias.clone(), options)
        .expect("linear_sample")
}

/// `(tokens, logp, lse[, entropy])` bits of one call, row-major per column.
fn sample_bits<B: InvariantBackend>(out: LinearSampleOutput<B>) -> Vec<Vec<u64>> {
    let tokens = out
        .tokens
        .into_data()
        .iter::<i64>()
        .map(|t| t as u64)
        .collect();
    let mut cols = vec![tokens, bits(out.logp), bits(out.lse)];
    cols.extend(out.entropy.map(bits));
    cols
}

/// A batch past 4096 rows, where the Sm90 forward passes switch from the ping-pong kernels to
/// the 128-row ones (`linear_logp` past 2048 rows, the sampler past 4096): its rows keep their
/// bits alone and in batches on either side of each bound, through `linear_logp_with_lse` and
/// `linear_sample` (greedy and Gumbel).
pub fn rows_across_pass_bound<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let [n, d, v] = [4200, 24, 1100];
    let p = logp_problem::<B>(device, dtype, [n, d, v], true, None, 517);
    let what = format!("{dtype:?} N {n} (past the bound)");
    let (logp, lse) = p.run();
    let (logp, lse) = (bits(logp), bits(lse));
    let base = SampleOptions::default().with_seed(77).with_entropy(true);
    let rules = [base.clone(), base.with_greedy(true)];
    let full: Vec<_> = rules
        .iter()
        .map(|o| sample_bits(sample(&p, p.hidden.clone(), p.targets.clone(), o)))
        .collect();
    let picks: [Vec<usize>; 4] = [
        vec![0, 1049, 2047, 2048, 4095, 4096, 4199],
        (4090..4160).collect(),
        (3..n).step_by(3).collect(),
        (1..n).step_by(2).collect(),
    ];
    for rows in picks {
        let part = p.select(&rows);
        let (l, e) = part.run();
        let (l, e) = (bits(l), bits(e));
        for (r, &i) in rows.iter().enumerate() {
            assert_eq!(l[r], logp[i], "{what}: logp row {i} of {} rows", rows.len());
            assert_eq!(e[r], lse[i], "{what}: lse row {i} of {} rows", rows.len());
        }
        for (o, whole) in rules.iter().zip(&full) {
            let got = sample_bits(sample(&p, part.hidden.clone(), part.targets.clone(), o));
            for (c, (got, whole)) in got.iter().zip(whole).enumerate() {
                for (r, &i) in rows.iter().enumerate() {
                    assert_eq!(
                        got[r],
                        whole[i],
                        "{what}: linear_sample {o:?} column {c} row {i} of {} rows",
                        rows.len()
                    );
                }
            }
        }
    }
}

/// The drawn tokens are in range and their `logp`, `lse`, `entropy` are bitwise
/// `linear_logp_full`'s for those targets, on shapes that are no multiple of any tile (V across
/// several vocabulary segments), with and without bias, for every option set.
pub fn sample_scores_are_linear_logp_full<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let shapes = [[1, 7, 13], [5, 33, 1009], [6, 19, 8229]];
    for (s, shape) in shapes.into_iter().enumerate() {
        let p = logp_problem::<B>(device, dtype, shape, s != 1, None, 700 + s as u64);
        for options in option_sets() {
            let what = format!("linear_sample {dtype:?} {shape:?} {options:?}");
            let out = sample(&p, p.hidden.clone(), p.targets.clone(), &options);
            let tokens: Vec<i64> = out.tokens.clone().into_data().iter::<i64>().collect();
            assert_eq!(tokens.len(), p.n, "{what}: tokens");
            for &t in &tokens {
                assert!((0..p.v as i64).contains(&t), "{what}: token {t}");
            }
            assert_eq!(out.entropy.is_some(), options.entropy, "{what}: entropy");
            let full = burn_invariant::linear_logp_full(
                p.hidden.clone(),
                p.weight.clone(),
                ints::<B>(tokens, device),
                p.bias.clone(),
                &options.logp_options(),
            )
            .expect("linear_logp_full");
            assert_bits_eq(&format!("{what}: logp"), &bits(out.logp), &bits(full.logp));
            assert_bits_eq(&format!("{what}: lse"), &bits(out.lse), &bits(full.lse));
            if let (Some(a), Some(b)) = (out.entropy, full.entropy) {
                assert_bits_eq(&format!("{what}: entropy"), &bits(a), &bits(b));
            }
        }
    }
}

/// A row's token and statistics depend on the row and its key alone: each row alone, the rows
/// in chunks, in reverse order (keys moving with their rows) and a rerun all give the full
/// batch's bits; another seed draws other tokens.
pub fn sample_row_invariance<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let [n, d, v] = [12, 33, 4099];
    let p = logp_problem::<B>(device, dtype, [n, d, v], true, None, 811);
    let hv: Vec<f32> = values(p.hidden.clone()).iter().map(|&x| x as f32).collect();
    let key_values: Vec<i64> = (0..n as i64).map(|i| 1000 + 7 * i - 40).collect();
    let rows = |range: std::ops::Range<usize>, order: &[usize]| {
        let picked: Vec<usize> = order.iter().map(|&i| range.start + i).collect();
        let h: Vec<f32> = picked
            .iter()
            .flat_map(|&i| hv[i * d..(i + 1) * d].to_vec())
            .collect();
        let k: Vec<i64> = picked.iter().map(|&i| key_values[i]).collect();
        (
            float::<B, 2>(h, [picked.len(), d], device, dtype),
            ints::<B>(k, device),
        )
    };
    for options in option_sets() {
        let what = format!("linear_sample {dtype:?} {options:?}");
        let all: Vec<usize> = (0..n).collect();
        let (h, k) = rows(0..n, &all);
        let full = sample_bits(sample(&p, h.clone(), k.clone(), &options));
        let again = sample_bits(sample(&p, h, k, &options));
        assert_eq!(full, again, "{what}: rerun");
        let row_of = |cols: &[Vec<u64>], i: usize| cols.iter().map(|c| c[i]).collect::<Vec<_>>();
        for i in 0..n {
            let (h, k) = rows(i..i + 1, &[0]);
            let alone = sample_bits(sample(&p, h, k, &options));
            assert_eq!(row_of(&alone, 0), row_of(&full, i), "{what}: row {i} alone");
        }
        for range in chunks(n, &[5, 9]) {
            let order: Vec<usize> = (0..range.len()).collect();
            let (h, k) = rows(range.clone(), &order);
            let part = sample_bits(sample(&p, h, k, &options));
            for (r, i) in range.clone().enumerate() {
                assert_eq!(
                    row_of(&part, r),
                    row_of(&full, i),
                    "{what}: chunk {range:?}"
                );
            }
        }
        let reversed: Vec<usize> = (0..n).rev().collect();
        let (h, k) = rows(0..n, &reversed);
        let back = sample_bits(sample(&p, h, k, &options));
        for (r, &i) in reversed.iter().enumerate() {
            assert_eq!(
                row_of(&back, r),
                row_of(&full, i),
                "{what}: reversed row {i}"
            );
        }
        if !options.greedy && options.top_k != Some(1) {
            let (h, k) = rows(0..n, &all);
            let other = sample_bits(sample(&p, h, k, &options.clone().with_seed(99)));
            assert_ne!(other[0], full[0], "{what}: another seed, the same tokens");
        }
    }
}

/// Greedy picks a largest logit (checked against f64 logits of the stored values, within their
/// f32 rounding), top-1 the same token, and top-5 one of the five largest.
pub fn sample_greedy_is_argmax<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    // V past three CubeCl segments and thirteen Sm90 ones.
    let [n, d, v] = [9, 21, 12365];
    let p = logp_problem::<B>(device, dtype, [n, d, v], true, None, 912);
    let greedy = SampleOptions::default().with_greedy(true);
    let out = sample(&p, p.hidden.clone(), p.targets.clone(), &greedy);
    let tokens: Vec<i64> = out.tokens.into_data().iter::<i64>().collect();
    let top1 = sample(
        &p,
        p.hidden.clone(),
        p.targets.clone(),
        &SampleOptions::default().with_top_k(1),
    );
    let top1: Vec<i64> = top1.tokens.into_data().iter::<i64>().collect();
    assert_eq!(tokens, top1, "greedy vs top-1");
    let top5 = SampleOptions::default().with_top_k(5);
    let top5 = sample(&p, p.hidden.clone(), p.targets.clone(), &top5);
    let top5: Vec<i64> = top5.tokens.into_data().iter::<i64>().collect();
    let (h, w) = (values(p.hidden.clone()), values(p.weight.clone()));
    let b = values(p.bias.clone().expect("bias"));
    for (i, (&t, &t5)) in tokens.iter().zip(&top5).enumerate() {
        let z = |j: usize| (0..d).map(|k| h[i * d + k] * w[j * d + k]).sum::<f64>() + b[j];
        let mut all: Vec<f64> = (0..v).map(z).collect();
        all.sort_by(|a, b| b.total_cmp(a));
        let zt = z(t as usize);
        assert!(
            zt >= all[0] - 1e-3,
            "row {i}: token {t} z {zt} < max {}",
            all[0]
        );
        let z5 = z(t5 as usize);
        assert!(
            z5 >= all[4] - 1e-3,
            "row {i}: top-5 token {t5} z {z5} < 5th {}",
            all[4]
        );
    }
}

/// The distribution tests' row `h` (`D = 3`), head `w [v, 3]` and exact logits `z` (f64).
pub fn one_row_head(v: usize) -> (Vec<f32>, Vec<f32>, Vec<f64>) {
    let d = 3;
    let h = vec![0.9f32, -0.4, 0.3];
    let w: Vec<f32> = (0..v * d)
        .map(|i| ((i * 37 % 23) as f32 / 11.0) - 1.0)
        .collect();
    let z = (0..v)
        .map(|j| (0..d).map(|k| h[k] as f64 * w[j * d + k] as f64).sum())
        .collect();
    (h, w, z)
}

/// Draws of one row over many keys against the exact (tempered, truncated) softmax: a
/// chi-square test with a fixed seed, for plain, tempered and top-k sampling.
pub fn sample_distribution<B: InvariantBackend>(device: &B::Device) {
    let (d, v, draws) = (3usize, 7usize, 40_000usize);
    let (h, w, z) = one_row_head(v);
    let hidden = float::<B, 2>(h.repeat(draws), [draws, d], device, DType::F32);
    let weight = float::<B, 2>(w, [v, d], device, DType::F32);
    let keys = ints::<B>((0..draws as i64).collect(), device);
    for (t, k) in [(1.0, None), (0.5, None), (1.6, Some(3))] {
        let mut options = SampleOptions::default().with_seed(2026).with_temperature(t);
        options.top_k = k;
        let out = burn_invariant::linear_sample(
            hidden.clone(),
            weight.clone(),
            keys.clone(),
            None,
            &options,
        )
        .expect("linear_sample");
        let mut counts = vec![0usize; v];
        for token in out.tokens.into_data().iter::<i64>() {
            counts[token as usize] += 1;
        }
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|&a, &b| z[b].total_cmp(&z[a]));
        let kept = &order[..k.unwrap_or(v)];
        let weights: Vec<f64> = (0..v)
            .map(|j| {
                if kept.contains(&j) {
                    (z[j] / t).exp()
                } else {
                    0.0
                }
            })
            .collect();
        let total: f64 = weights.iter().sum();
        let mut chi2 = 0.0;
        for j in 0..v {
            let expected = draws as f64 * weights[j] / total;
            if expected == 0.0 {
                assert_eq!(counts[j], 0, "T={t} k={k:?}: token {j} outside the top-k");
            } else {
                chi2 += (counts[j] as f64 - expected).powi(2) / expected;
            }
        }
        // At most 6 degrees of freedom: p < 1e-6 beyond about 36.
        assert!(chi2 < 36.0, "T={t} k={k:?}: chi2 {chi2}, counts {counts:?}");
    }
}

/// Typed errors for bad options and shapes, and nothing drawn for N = 0.
pub fn sample_bad_input<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let p = logp_problem::<B>(device, dtype, [3, 5, 11], true, None, 5);
    let run = |hidden: Tensor<B, 2>, weight: Tensor<B, 2>, keys, bias, o: &SampleOptions| {
        burn_invariant::linear_sample(hidden, weight, keys, bias, o).map(|_| ())
    };
    let call = |o: &SampleOptions| {
        run(
            p.hidden.clone(),
            p.weight.clone(),
            p.targets.clone(),
            p.bias.clone(),
            o,
        )
    };
    let arg_of = |r: Result<(), InvariantError>| match r {
        Err(InvariantError::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    let base = SampleOptions::default();
    for t in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert_eq!(
            arg_of(call(&base.clone().with_temperature(t))),
            "temperature"
        );
    }
    for k in [0, burn_invariant::TOP_K_MAX + 1] {
        assert_eq!(arg_of(call(&base.clone().with_top_k(k))), "top_k");
    }
    let top_p = SampleOptions {
        top_p: Some(0.9),
        ..base.clone()
    };
    assert_eq!(arg_of(call(&top_p)), "top_p");
    let min_p = SampleOptions {
        min_p: Some(0.1),
        ..base.clone()
    };
    assert_eq!(arg_of(call(&min_p)), "min_p");
    let shape_arg = |r: Result<(), InvariantError>| match r {
        Err(InvariantError::Shape { arg, .. }) => arg,
        other => panic!("expected Shape, got {other:?}"),
    };
    let long_keys = ints::<B>(vec![1, 2, 3, 4], device);
    let r = run(
        p.hidden.clone(),
        p.weight.clone(),
        long_keys,
        p.bias.clone(),
        &base,
    );
    assert_eq!(shape_arg(r), "keys");
    let short_bias = float::<B, 1>(vec![0.0; 10], [10], device, dtype);
    let r = run(
        p.hidden.clone(),
        p.weight.clone(),
        p.targets.clone(),
        Some(short_bias),
        &base,
    );
    assert_eq!(shape_arg(r), "bias");
    let wide = float::<B, 2>(vec![0.0; 11 * 6], [11, 6], device, dtype);
    let r = run(p.hidden.clone(), wide, p.targets.clone(), None, &base);
    assert_eq!(shape_arg(r), "weight");
    // A vocabulary past 2^24 (D = 0 keeps it small). `empty`, not `from_data`: cubecl-cuda
    // refuses a write whose strides hold a zero and queues the error on the thread's stream.
    let huge = Tensor::<B, 2>::empty([(1 << 24) + 1, 0], (device, dtype));
    let empty_rows = Tensor::<B, 2>::empty([2, 0], (device, dtype));
    match run(empty_rows, huge, ints::<B>(vec![0, 1], device), None, &base) {
        Err(InvariantError::TooLarge { arg: "weight", .. }) => {}
        other => panic!("expected TooLarge for V > 2^24, got {other:?}"),
    }
    let none = float::<B, 2>(vec![], [0, 5], device, dtype);
    let out = burn_invariant::linear_sample(
        none,
        p.weight.clone(),
        ints::<B>(vec![], device),
        None,
        &base.with_entropy(true),
    )
    .expect("N = 0");
    assert_eq!(out.tokens.dims(), [0]);
    assert_eq!(out.entropy.map(|e| e.dims()), Some([0]));
}

/// Tensor-parallel greedy and top-k with the in-process group, every rank on `device`: the same
/// tokens on every rank and for worlds 1, 2 and 4, with bitwise statistics; greedy a largest logit
/// (f64 check as above), top-k one of the k largest. Where the single-rank sampler ranks the top-k
/// lists' own logits (every implementation but Sm90, whose pass has its own), greedy and top-1
/// are the single-rank tokens.
pub fn tp_sample_ranked<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    use burn_invariant::registry::{Implementation, Op, implementation_for};
    use burn_invariant::tp::{self, InProcessGroup, VocabShard};
    use std::sync::Arc;

    let [n, d, v] = [7, 21, 12365];
    let p = logp_problem::<B>(device, dtype, [n, d, v], true, None, 913);
    let host = |t: Tensor<B, 2>| {
        values(t)
            .into_iter()
            .map(|x| x as f32)
            .collect::<Vec<f32>>()
    };
    let (h, w) = (host(p.hidden.clone()), host(p.weight.clone()));
    let b: Vec<f32> = values(p.bias.clone().expect("bias"))
        .into_iter()
        .map(|x| x as f32)
        .collect();
    let shared = Arc::new((h.clone(), w.clone(), b.clone(), p.target_values.clone()));
    let sharded = Implementation::Sm90
        != implementation_for::<B>(Op::LinearLogp, device, dtype).expect("registry");
    for options in [
        SampleOptions::default()
            .with_greedy(true)
            .with_temperature(1.3),
        SampleOptions::default().with_top_k(1).with_entropy(true),
        SampleOptions::default().with_top_k(5).with_temperature(0.9),
        SampleOptions::default().with_top_k(64).with_entropy(true),
    ] {
        let what = format!("tp linear_sample {dtype:?} {options:?}");
        let mut first: Option<Vec<Vec<u64>>> = None;
        for world in [1, 2, 4] {
            let (shared, device, options) = (shared.clone(), device.clone(), options.clone());
            let outs = super::ranks::on_ranks(
                InProcessGroup::new(world),
                std::time::Duration::from_secs(300),
                move |rank, group| {
                    let (h, w, b, keys) = &*shared;
                    let shard = VocabShard::split(rank, world, v);
                    let r = shard.range();
                    let out = tp::linear_sample(
                        float::<B, 2>(h.clone(), [n, d], &device, dtype),
                        super::matrix_rows::<B>(w, d, r.clone(), &device, dtype),
                        ints::<B>(keys.clone(), &device),
                        Some(float::<B, 1>(b[r].to_vec(), [shard.len()], &device, dtype)),
                        &shard,
                        &group,
                        &options,
                    )
                    .expect("tp::linear_sample");
                    let bits = sample_bits(out);
                    B::sync(&device).expect("the rank's device work");
                    bits
                },
            );
            for (rank, out) in outs.into_iter().enumerate() {
                match &first {
                    None => first = Some(out),
                    Some(want) => {
                        for (c, (got, want)) in out.iter().zip(want).enumerate() {
                            assert_bits_eq(
                                &format!("{what} world {world} rank {rank} column {c}"),
                                got,
                                want,
                            );
                        }
                    }
                }
            }
        }
        let tokens: Vec<i64> = first.expect("world 1")[0]
            .iter()
            .map(|&t| t as i64)
            .collect();
        let k = options.top_k.unwrap_or(1);
        for (i, &t) in tokens.iter().enumerate() {
            let z = |j: usize| {
                (0..d)
                    .map(|c| h[i * d + c] as f64 * w[j * d + c] as f64)
                    .sum::<f64>()
                    + b[j] as f64
            };
            let mut all: Vec<f64> = (0..v).map(z).collect();
            all.sort_by(|a, b| b.total_cmp(a));
            assert!(
                (0..v as i64).contains(&t) && z(t as usize) >= all[k - 1] - 1e-3,
                "{what} row {i}: token {t} not among the {k} largest"
            );
        }
        if sharded && k == 1 {
            let single = sample(&p, p.hidden.clone(), p.targets.clone(), &options);
            let single: Vec<i64> = single.tokens.into_data().iter::<i64>().collect();
            assert_eq!(tokens, single, "{what}: tp vs single rank");
        }
    }
}
