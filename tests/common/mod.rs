//! Backend-generic invariance, correctness, gradient and bad-input suites.
//!
//! `invariant_testsuite!` expands every suite into `#[test]`s for one backend, so a new
//! backend is one line in a test file. Invariance is checked bitwise; correctness against an
//! f64 computation on the values actually stored on the device, with dtype-aware tolerances.
#![allow(dead_code)]

pub mod model;
pub mod ops;
pub mod ranks;
pub mod rl_head;
pub mod sampler;
pub mod tp_problem;

use burn::tensor::{
    DType, Int, Tensor, TensorData,
    backend::{AutodiffBackend, Backend},
};
use burn_invariant::{InvariantBackend, InvariantError, LinearLogpOptions};

// ---------------------------------------------------------------------------------------------
// Data

/// Deterministic xorshift stream in [-1, 1).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|_| self.uniform() * scale).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub fn float<B: Backend, const D: usize>(
    data: Vec<f32>,
    shape: [usize; D],
    device: &B::Device,
    dtype: DType,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(data, shape), (device, dtype))
}

/// Rows `rows` of a row-major `[_, d]` host matrix as a `[rows.len(), d]` tensor (a rank's
/// shard of a weight).
pub fn matrix_rows<B: Backend>(
    data: &[f32],
    d: usize,
    rows: std::ops::Range<usize>,
    device: &B::Device,
    dtype: DType,
) -> Tensor<B, 2> {
    let n = rows.len();
    float(
        data[rows.start * d..rows.end * d].to_vec(),
        [n, d],
        device,
        dtype,
    )
}

pub fn ints<B: Backend>(data: Vec<i64>, device: &B::Device) -> Tensor<B, 1, Int> {
    let n = data.len();
    Tensor::from_data(TensorData::new(data, [n]), device)
}

/// Exact values as f64 (every float dtype converts exactly).
pub fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    t.into_data().iter::<f64>().collect()
}

/// Bit patterns (of the exact f64 value), for bitwise comparisons in any dtype.
pub fn bits<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<u64> {
    values(t).into_iter().map(f64::to_bits).collect()
}

pub fn assert_bits_eq(what: &str, got: &[u64], expected: &[u64]) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    let differ = got.iter().zip(expected).filter(|(a, b)| a != b).count();
    let first = got.iter().zip(expected).position(|(a, b)| a != b);
    let shown = first.map(|i| (i, f64::from_bits(got[i]), f64::from_bits(expected[i])));
    assert_eq!(
        differ,
        0,
        "{what}: {differ}/{} elements differ bitwise; first (index, got, expected): {shown:?}",
        got.len()
    );
}

/// Rows `range` of a flattened row-major matrix with `cols` columns.
pub fn rows_of(data: &[u64], cols: usize, range: std::ops::Range<usize>) -> Vec<u64> {
    data[range.start * cols..range.end * cols].to_vec()
}

/// Unit roundoff of the storage dtype (for output rounding).
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        _ => 2f64.powi(-24),
    }
}

/// Half the spacing of `dtype`'s subnormals: the absolute error of rounding a tiny result.
pub fn subnormal_half_ulp(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-134),
        DType::F16 => 2f64.powi(-25),
        _ => 2f64.powi(-150),
    }
}

/// Tolerance for an f32-accumulated sum of `terms` products with absolute sum `abs_sum`,
/// rounded to `dtype` (relatively, or by half a subnormal step where the result is that small).
pub fn gemm_tolerance(dtype: DType, terms: usize, abs_sum: f64) -> f64 {
    ((terms as f64 + 2.0) * 2f64.powi(-24) + unit_roundoff(dtype)) * abs_sum
        + subnormal_half_ulp(dtype)
}

// ---------------------------------------------------------------------------------------------
// Problems

/// A matmul problem with its device tensors.
pub struct Gemm<B: Backend> {
    pub lhs: Tensor<B, 2>,
    pub rhs: Tensor<B, 2>,
    pub bias: Option<Tensor<B, 1>>,
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

pub fn gemm_problem<B: Backend>(
    device: &B::Device,
    dtype: DType,
    [m, k, n]: [usize; 3],
    with_bias: bool,
    seed: u64,
) -> Gemm<B> {
    let mut rng = Rng::new(seed);
    Gemm {
        lhs: float(rng.vec(m * k, 1.0), [m, k], device, dtype),
        rhs: float(rng.vec(k * n, 1.0), [k, n], device, dtype),
        bias: with_bias.then(|| float(rng.vec(n, 1.0), [n], device, dtype)),
        m,
        k,
        n,
    }
}

/// A linear_logp problem with its device tensors.
pub struct Logp<B: Backend> {
    pub hidden: Tensor<B, 2>,
    pub weight: Tensor<B, 2>,
    pub bias: Option<Tensor<B, 1>>,
    pub targets: Tensor<B, 1, Int>,
    pub target_values: Vec<i64>,
    pub options: LinearLogpOptions,
    pub n: usize,
    pub d: usize,
    pub v: usize,
}

pub const IGNORE: i64 = -100;

pub fn logp_problem<B: Backend>(
    device: &B::Device,
    dtype: DType,
    [n, d, v]: [usize; 3],
    with_bias: bool,
    ignore_every: Option<usize>,
    seed: u64,
) -> Logp<B> {
    let mut rng = Rng::new(seed);
    // Logits of order 1–10 so the softmax is neither flat nor one-hot.
    let scale = 3.0 / (d as f32).sqrt().max(1.0);
    let target_values: Vec<i64> = (0..n)
        .map(|i| match ignore_every {
            Some(every) if i % every == every - 1 => IGNORE,
            _ => rng.below(v) as i64,
        })
        .collect();
    Logp {
        hidden: float(rng.vec(n * d, 1.0), [n, d], device, dtype),
        weight: float(rng.vec(v * d, scale), [v, d], device, dtype),
        bias: with_bias.then(|| float(rng.vec(v, 1.0), [v], device, dtype)),
        targets: ints::<B>(target_values.clone(), device),
        target_values,
        options: LinearLogpOptions {
            ignore_index: ignore_every.map(|_| IGNORE),
            ..Default::default()
        },
        n,
        d,
        v,
    }
}

impl<B: InvariantBackend> Logp<B> {
    pub fn run(&self) -> (Tensor<B, 1>, Tensor<B, 1>) {
        burn_invariant::linear_logp_with_lse(
            self.hidden.clone(),
            self.weight.clone(),
            self.targets.clone(),
            self.bias.clone(),
            &self.options,
        )
        .expect("linear_logp_with_lse")
    }

    /// The same problem restricted to rows `rows` (an index list, any order).
    pub fn select(&self, rows: &[usize]) -> Self {
        let device = self.hidden.device();
        let idx = ints::<B>(rows.iter().map(|&r| r as i64).collect(), &device);
        let target_values: Vec<i64> = rows.iter().map(|&r| self.target_values[r]).collect();
        Self {
            hidden: self.hidden.clone().select(0, idx),
            weight: self.weight.clone(),
            bias: self.bias.clone(),
            targets: ints::<B>(target_values.clone(), &device),
            target_values,
            options: self.options.clone(),
            n: rows.len(),
            d: self.d,
            v: self.v,
        }
    }

    /// Rows `extra` appended (the first `self.n` rows unchanged).
    pub fn padded(&self, extra: usize, seed: u64) -> Self {
        let device = self.hidden.device();
        let pad = logp_problem::<B>(
            &device,
            self.hidden.dtype(),
            [extra, self.d, self.v],
            false,
            None,
            seed,
        );
        let mut target_values = self.target_values.clone();
        target_values.extend(&pad.target_values);
        Self {
            hidden: Tensor::cat(vec![self.hidden.clone(), pad.hidden], 0),
            weight: self.weight.clone(),
            bias: self.bias.clone(),
            targets: ints::<B>(target_values.clone(), &device),
            target_values,
            options: self.options.clone(),
            n: self.n + extra,
            d: self.d,
            v: self.v,
        }
    }
}

impl<B: InvariantBackend> Logp<B> {
    /// Rows `extra` appended whose activations are all `value` (Inf / NaN padding).
    pub fn padded_with(&self, extra: usize, value: f32, seed: u64) -> Self {
        let mut p = self.padded(extra, seed);
        let device = self.hidden.device();
        let fill = Tensor::<B, 2>::full([extra, self.d], value, (&device, self.hidden.dtype()));
        p.hidden = Tensor::cat(vec![self.hidden.clone(), fill], 0);
        p
    }
}

pub fn matmul<B: InvariantBackend>(p: &Gemm<B>) -> Tensor<B, 2> {
    match &p.bias {
        None => burn_invariant::matmul(p.lhs.clone(), p.rhs.clone()),
        Some(bias) => burn_invariant::linear(p.lhs.clone(), p.rhs.clone(), Some(bias.clone())),
    }
    .expect("matmul")
}

fn select_rows<B: Backend>(t: &Tensor<B, 2>, rows: &[usize]) -> Tensor<B, 2> {
    let idx = ints::<B>(rows.iter().map(|&r| r as i64).collect(), &t.device());
    t.clone().select(0, idx)
}

/// Splits `0..n` into consecutive chunks at the given (non-tile) boundaries.
pub fn chunks(n: usize, cuts: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut bounds: Vec<usize> = cuts.iter().copied().filter(|&c| c > 0 && c < n).collect();
    bounds.sort_unstable();
    bounds.dedup();
    bounds.insert(0, 0);
    bounds.push(n);
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

/// A fixed permutation of `0..n`.
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = Rng::new(seed);
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        p.swap(i, rng.below(i + 1));
    }
    p
}

// ---------------------------------------------------------------------------------------------
// Invariance suites (bitwise)

pub const GEMM_SHAPES: [[usize; 3]; 3] = [[37, 53, 29], [130, 67, 70], [5, 1, 3]];

pub fn matmul_row_invariance<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    for (s, &shape) in GEMM_SHAPES.iter().enumerate() {
        for with_bias in [false, true] {
            let p = gemm_problem::<B>(device, dtype, shape, with_bias, 11 + s as u64);
            let what = format!("matmul {dtype:?} {shape:?} bias={with_bias}");
            let full = bits(matmul(&p));
            // Row alone vs in the batch.
            for row in [0, p.m / 2, p.m - 1] {
                let alone = Gemm {
                    lhs: select_rows(&p.lhs, &[row]),
                    rhs: p.rhs.clone(),
                    bias: p.bias.clone(),
                    m: 1,
                    ..p
                };
                assert_bits_eq(
                    &format!("{what}: row {row} alone"),
                    &bits(matmul(&alone)),
                    &rows_of(&full, p.n, row..row + 1),
                );
            }
            // Chunked calls vs one call (cuts at non-tile boundaries).
            let mut chunked = Vec::new();
            for range in chunks(p.m, &[3, 17, 18, 100]) {
                let rows: Vec<usize> = range.collect();
                let part = Gemm {
                    lhs: select_rows(&p.lhs, &rows),
                    rhs: p.rhs.clone(),
                    bias: p.bias.clone(),
                    m: rows.len(),
                    ..p
                };
                chunked.extend(bits(matmul(&part)));
            }
            assert_bits_eq(&format!("{what}: chunked"), &chunked, &full);
            // Appended padding rows.
            let pad = float::<B, 2>(Rng::new(99).vec(23 * p.k, 5.0), [23, p.k], device, dtype);
            let padded = Gemm {
                lhs: Tensor::cat(vec![p.lhs.clone(), pad], 0),
                rhs: p.rhs.clone(),
                bias: p.bias.clone(),
                m: p.m + 23,
                ..p
            };
            assert_bits_eq(
                &format!("{what}: padded"),
                &rows_of(&bits(matmul(&padded)), p.n, 0..p.m),
                &full,
            );
            // Permuted rows.
            let perm = permutation(p.m, 5);
            let permuted = Gemm {
                lhs: select_rows(&p.lhs, &perm),
                rhs: p.rhs.clone(),
                bias: p.bias.clone(),
                m: p.m,
                ..p
            };
            let got = bits(matmul(&permuted));
            for (dst, &src) in perm.iter().enumerate() {
                assert_bits_eq(
                    &format!("{what}: permuted row {src}"),
                    &rows_of(&got, p.n, dst..dst + 1),
                    &rows_of(&full, p.n, src..src + 1),
                );
            }
            // Rerun.
            for _ in 0..10 {
                assert_bits_eq(&format!("{what}: rerun"), &bits(matmul(&p)), &full);
            }
        }
    }
}

/// `(dLhs, dRhs, dBias)` of one matmul.
pub type MatmulGrads<B> = (Tensor<B, 2>, Tensor<B, 2>, Option<Tensor<B, 1>>);

/// Gradients of `sum(matmul(lhs, rhs) + bias) ⊙ g)`, i.e. upstream gradient exactly `g`.
pub fn matmul_grads<B: AutodiffBackend + InvariantBackend>(
    p: &Gemm<B>,
    upstream: &Tensor<B, 2>,
) -> MatmulGrads<B::InnerBackend> {
    let lhs = p.lhs.clone().require_grad();
    let rhs = p.rhs.clone().require_grad();
    let bias = p.bias.clone().map(|b| b.require_grad());
    let out = match &bias {
        None => burn_invariant::matmul(lhs.clone(), rhs.clone()),
        Some(b) => burn_invariant::linear(lhs.clone(), rhs.clone(), Some(b.clone())),
    }
    .expect("matmul");
    let grads = (out * upstream.clone()).sum().backward();
    (
        lhs.grad(&grads).expect("lhs grad"),
        rhs.grad(&grads).expect("rhs grad"),
        bias.map(|b| b.grad(&grads).expect("bias grad")),
    )
}

pub fn matmul_backward_invariance<B: AutodiffBackend + InvariantBackend>(
    device: &B::Device,
    dtype: DType,
) {
    let [m, k, n] = [37, 53, 29];
    let p = gemm_problem::<B>(device, dtype, [m, k, n], true, 21);
    let g = float::<B, 2>(Rng::new(22).vec(m * n, 1.0), [m, n], device, dtype);
    let what = format!("matmul backward {dtype:?}");
    let (dl, dr, db) = matmul_grads(&p, &g);
    let (dl, dr, db) = (bits(dl), bits(dr), bits(db.expect("bias")));
    // dLhs: row alone vs in the batch, and chunked.
    for range in chunks(m, &[1, 2, 19]) {
        let rows: Vec<usize> = range.clone().collect();
        let part = Gemm {
            lhs: select_rows(&p.lhs, &rows),
            rhs: p.rhs.clone(),
            bias: p.bias.clone(),
            m: rows.len(),
            ..p
        };
        let (pl, _, _) = matmul_grads(&part, &select_rows(&g, &rows));
        assert_bits_eq(
            &format!("{what}: dLhs rows {range:?}"),
            &bits(pl),
            &rows_of(&dl, k, range),
        );
    }
    // dRhs, dBias: appended rows with zero upstream gradient leave them unchanged.
    let pad_rows = 41;
    let padded = Gemm {
        lhs: Tensor::cat(
            vec![
                p.lhs.clone(),
                float(
                    Rng::new(23).vec(pad_rows * k, 3.0),
                    [pad_rows, k],
                    device,
                    dtype,
                ),
            ],
            0,
        ),
        rhs: p.rhs.clone(),
        bias: p.bias.clone(),
        m: m + pad_rows,
        ..p
    };
    let g_padded = Tensor::cat(
        vec![g.clone(), Tensor::zeros([pad_rows, n], (device, dtype))],
        0,
    );
    let (pl, pr, pb) = matmul_grads(&padded, &g_padded);
    assert_bits_eq(
        &format!("{what}: dRhs with zero-grad padding"),
        &bits(pr),
        &dr,
    );
    assert_bits_eq(
        &format!("{what}: dBias with zero-grad padding"),
        &bits(pb.expect("bias")),
        &db,
    );
    assert_bits_eq(
        &format!("{what}: dLhs with padding"),
        &rows_of(&bits(pl), k, 0..m),
        &dl,
    );
    // Rerun determinism of all three.
    for _ in 0..10 {
        let (l, r, b) = matmul_grads(&p, &g);
        assert_bits_eq(&format!("{what}: rerun dLhs"), &bits(l), &dl);
        assert_bits_eq(&format!("{what}: rerun dRhs"), &bits(r), &dr);
        assert_bits_eq(
            &format!("{what}: rerun dBias"),
            &bits(b.expect("bias")),
            &db,
        );
    }
}

pub const LOGP_SHAPES: [[usize; 3]; 2] = [[29, 67, 1009], [9, 5, 50021]];

pub fn logp_row_invariance<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    for (s, &shape) in LOGP_SHAPES.iter().enumerate() {
        for with_bias in [false, true] {
            let p = logp_problem::<B>(device, dtype, shape, with_bias, Some(4), 31 + s as u64);
            let what = format!("linear_logp {dtype:?} {shape:?} bias={with_bias}");
            let (logp, lse) = p.run();
            let (logp, lse) = (bits(logp), bits(lse));
            for row in [0, p.n / 2, p.n - 1] {
                let (l, e) = p.select(&[row]).run();
                assert_bits_eq(
                    &format!("{what}: logp row {row} alone"),
                    &bits(l),
                    &logp[row..row + 1],
                );
                assert_bits_eq(
                    &format!("{what}: lse row {row} alone"),
                    &bits(e),
                    &lse[row..row + 1],
                );
            }
            let (mut cl, mut ce) = (Vec::new(), Vec::new());
            for range in chunks(p.n, &[2, 3, 7]) {
                let (l, e) = p.select(&range.collect::<Vec<_>>()).run();
                cl.extend(bits(l));
                ce.extend(bits(e));
            }
            assert_bits_eq(&format!("{what}: logp chunked"), &cl, &logp);
            assert_bits_eq(&format!("{what}: lse chunked"), &ce, &lse);
            let (l, e) = p.padded(13, 77).run();
            assert_bits_eq(&format!("{what}: logp padded"), &bits(l)[..p.n], &logp);
            assert_bits_eq(&format!("{what}: lse padded"), &bits(e)[..p.n], &lse);
            let perm = permutation(p.n, 8);
            let (l, e) = p.select(&perm).run();
            let (l, e) = (bits(l), bits(e));
            for (dst, &src) in perm.iter().enumerate() {
                assert_eq!(l[dst], logp[src], "{what}: permuted logp row {src}");
                assert_eq!(e[dst], lse[src], "{what}: permuted lse row {src}");
            }
            for _ in 0..10 {
                let (l, e) = p.run();
                assert_bits_eq(&format!("{what}: rerun logp"), &bits(l), &logp);
                assert_bits_eq(&format!("{what}: rerun lse"), &bits(e), &lse);
            }
        }
    }
}

/// Gradients of `Σ g_logp·logp + g_lse·lse` (so the upstream gradients are exactly those).
pub struct LogpGrads<B: Backend> {
    pub hidden: Tensor<B, 2>,
    pub weight: Tensor<B, 2>,
    pub bias: Option<Tensor<B, 1>>,
}

pub fn logp_grads<B: AutodiffBackend + InvariantBackend>(
    p: &Logp<B>,
    g_logp: &Tensor<B, 1>,
    g_lse: &Tensor<B, 1>,
) -> LogpGrads<B::InnerBackend> {
    let hidden = p.hidden.clone().require_grad();
    let weight = p.weight.clone().require_grad();
    let bias = p.bias.clone().map(|b| b.require_grad());
    let (logp, lse) = burn_invariant::linear_logp_with_lse(
        hidden.clone(),
        weight.clone(),
        p.targets.clone(),
        bias.clone(),
        &p.options,
    )
    .expect("linear_logp_with_lse");
    let grads = (logp * g_logp.clone() + lse * g_lse.clone())
        .sum()
        .backward();
    LogpGrads {
        hidden: hidden.grad(&grads).expect("hidden grad"),
        weight: weight.grad(&grads).expect("weight grad"),
        bias: bias.map(|b| b.grad(&grads).expect("bias grad")),
    }
}

pub fn logp_backward_invariance<B: AutodiffBackend + InvariantBackend>(
    device: &B::Device,
    dtype: DType,
) {
    let p = logp_problem::<B>(device, dtype, [23, 45, 613], true, Some(5), 41);
    let mut rng = Rng::new(42);
    let g_logp = float::<B, 1>(rng.vec(p.n, 1.0), [p.n], device, DType::F32);
    let g_lse = float::<B, 1>(rng.vec(p.n, 0.1), [p.n], device, DType::F32);
    let what = format!("linear_logp backward {dtype:?}");
    let full = logp_grads(&p, &g_logp, &g_lse);
    let dh = bits(full.hidden.clone());
    let dw = bits(full.weight.clone());
    let db = bits(full.bias.clone().expect("bias"));
    let select1 = |t: &Tensor<B, 1>, rows: &[usize]| {
        t.clone().select(
            0,
            ints::<B>(rows.iter().map(|&r| r as i64).collect(), device),
        )
    };
    for range in chunks(p.n, &[1, 2, 11]) {
        let rows: Vec<usize> = range.clone().collect();
        let part = logp_grads(
            &p.select(&rows),
            &select1(&g_logp, &rows),
            &select1(&g_lse, &rows),
        );
        assert_bits_eq(
            &format!("{what}: dHidden rows {range:?}"),
            &bits(part.hidden),
            &rows_of(&dh, p.d, range),
        );
    }
    // dWeight/dBias: appended rows with zero upstream gradient change nothing.
    let padded = p.padded(17, 43);
    let zeros = Tensor::<B, 1>::zeros([17], (device, DType::F32));
    let pg = logp_grads(
        &padded,
        &Tensor::cat(vec![g_logp.clone(), zeros.clone()], 0),
        &Tensor::cat(vec![g_lse.clone(), zeros], 0),
    );
    assert_bits_eq(
        &format!("{what}: dWeight with zero-grad padding"),
        &bits(pg.weight),
        &dw,
    );
    assert_bits_eq(
        &format!("{what}: dBias with zero-grad padding"),
        &bits(pg.bias.expect("bias")),
        &db,
    );
    assert_bits_eq(
        &format!("{what}: dHidden with padding"),
        &bits(pg.hidden)[..p.n * p.d],
        &dh,
    );
    // Padding rows holding Inf or NaN with zero upstream gradients add exactly nothing either.
    for value in [f32::INFINITY, f32::NAN] {
        let padded = p.padded_with(17, value, 44);
        let zeros = Tensor::<B, 1>::zeros([17], (device, DType::F32));
        let pg = logp_grads(
            &padded,
            &Tensor::cat(vec![g_logp.clone(), zeros.clone()], 0),
            &Tensor::cat(vec![g_lse.clone(), zeros], 0),
        );
        let pad = format!("{what}: {value} padding");
        assert_bits_eq(&format!("{pad}: dWeight"), &bits(pg.weight), &dw);
        assert_bits_eq(&format!("{pad}: dBias"), &bits(pg.bias.expect("bias")), &db);
        assert_bits_eq(
            &format!("{pad}: dHidden"),
            &bits(pg.hidden)[..p.n * p.d],
            &dh,
        );
    }
    for _ in 0..10 {
        let again = logp_grads(&p, &g_logp, &g_lse);
        assert_bits_eq(&format!("{what}: rerun dHidden"), &bits(again.hidden), &dh);
        assert_bits_eq(&format!("{what}: rerun dWeight"), &bits(again.weight), &dw);
        assert_bits_eq(
            &format!("{what}: rerun dBias"),
            &bits(again.bias.expect("bias")),
            &db,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Correctness against f64

/// Checks `got [m, n]` against `lhs·rhs + bias` in f64 from the stored values.
pub fn check_gemm_f64(
    what: &str,
    dtype: DType,
    lhs: &[f64],
    rhs: &[f64],
    bias: Option<&[f64]>,
    got: &[f64],
    [m, k, n]: [usize; 3],
) {
    for i in 0..m {
        for j in 0..n {
            let (mut exact, mut abs) = (0.0f64, 0.0f64);
            for p in 0..k {
                exact += lhs[i * k + p] * rhs[p * n + j];
                abs += (lhs[i * k + p] * rhs[p * n + j]).abs();
            }
            if let Some(b) = bias {
                exact += b[j];
                abs += b[j].abs();
            }
            let err = (got[i * n + j] - exact).abs();
            let tol = gemm_tolerance(dtype, k + 1, abs);
            assert!(
                err <= tol,
                "{what}: out[{i},{j}] = {} vs exact {exact}, err {err:e} > tol {tol:e}",
                got[i * n + j]
            );
        }
    }
}

pub fn matmul_correctness<B: InvariantBackend>(
    device: &B::Device,
    dtype: DType,
    shape: [usize; 3],
    with_bias: bool,
    seed: u64,
) {
    let p = gemm_problem::<B>(device, dtype, shape, with_bias, seed);
    let got = values(matmul(&p));
    let bias = p.bias.clone().map(values);
    check_gemm_f64(
        &format!("matmul {dtype:?} {shape:?}"),
        dtype,
        &values(p.lhs.clone()),
        &values(p.rhs.clone()),
        bias.as_deref(),
        &got,
        shape,
    );
}

/// Exact `(logp, lse, z)` of one row in f64.
pub fn logp_row_f64(
    h: &[f64],
    w: &[f64],
    b: Option<&[f64]>,
    target: i64,
    d: usize,
    v: usize,
) -> (f64, f64, Vec<f64>) {
    let z: Vec<f64> = (0..v)
        .map(|j| (0..d).map(|k| h[k] * w[j * d + k]).sum::<f64>() + b.map_or(0.0, |b| b[j]))
        .collect();
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + z.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    let logp = if (0..v as i64).contains(&target) {
        z[target as usize] - lse
    } else {
        0.0
    };
    (logp, lse, z)
}

pub fn logp_correctness<B: InvariantBackend>(
    device: &B::Device,
    dtype: DType,
    shape: [usize; 3],
    with_bias: bool,
    seed: u64,
) {
    let p = logp_problem::<B>(device, dtype, shape, with_bias, Some(3), seed);
    let (logp, lse) = p.run();
    let (logp, lse) = (values(logp), values(lse));
    let (h, w) = (values(p.hidden.clone()), values(p.weight.clone()));
    let b = p.bias.clone().map(values);
    let [n, d, v] = shape;
    for i in 0..n {
        let (el, ee, z) = logp_row_f64(
            &h[i * d..(i + 1) * d],
            &w,
            b.as_deref(),
            p.target_values[i],
            d,
            v,
        );
        // Logit error of an f32 dot product, plus f32 rounding of exp/log over V terms.
        let zmax = z.iter().fold(0.0f64, |a, x| a.max(x.abs()));
        let tol =
            1e-5 * (1.0 + zmax) * (d as f64).sqrt().max(1.0) + 2e-6 * (v as f64).ln().max(1.0);
        assert!(
            (lse[i] - ee).abs() <= tol,
            "linear_logp {dtype:?} {shape:?}: lse[{i}] {} vs {ee}, tol {tol:e}",
            lse[i]
        );
        if p.target_values[i] == IGNORE {
            assert_eq!(logp[i], 0.0, "ignored row {i} must give logp = 0");
        } else {
            assert!(
                (logp[i] - el).abs() <= 2.0 * tol,
                "linear_logp {dtype:?} {shape:?}: logp[{i}] {} vs {el}, tol {tol:e}",
                logp[i]
            );
        }
    }
}

pub fn matmul_gradients_f64<B: AutodiffBackend + InvariantBackend>(
    device: &B::Device,
    dtype: DType,
) {
    let [m, k, n] = [19, 23, 17];
    let p = gemm_problem::<B>(device, dtype, [m, k, n], true, 51);
    let g = float::<B, 2>(Rng::new(52).vec(m * n, 1.0), [m, n], device, dtype);
    let (dl, dr, db) = matmul_grads(&p, &g);
    let (a, b, gv) = (
        values(p.lhs.clone()),
        values(p.rhs.clone()),
        values(g.clone()),
    );
    // dLhs = g · rhsᵀ
    let rhs_t: Vec<f64> = (0..n * k).map(|x| b[(x % k) * n + x / k]).collect();
    check_gemm_f64(
        &format!("dLhs {dtype:?}"),
        dtype,
        &gv,
        &rhs_t,
        None,
        &values(dl),
        [m, n, k],
    );
    // dRhs = lhsᵀ · g
    let lhs_t: Vec<f64> = (0..k * m).map(|x| a[(x % m) * k + x / m]).collect();
    check_gemm_f64(
        &format!("dRhs {dtype:?}"),
        dtype,
        &lhs_t,
        &gv,
        None,
        &values(dr),
        [k, m, n],
    );
    // dBias = Σ_rows g
    let ones = vec![1.0f64; m];
    check_gemm_f64(
        &format!("dBias {dtype:?}"),
        dtype,
        &ones,
        &gv,
        None,
        &values(db.expect("bias")),
        [1, m, n],
    );
}

pub fn logp_gradients_f64<B: AutodiffBackend + InvariantBackend>(
    device: &B::Device,
    dtype: DType,
    shape: [usize; 3],
) {
    let p = logp_problem::<B>(device, dtype, shape, true, Some(4), 61);
    let [n, d, v] = shape;
    let mut rng = Rng::new(62);
    let (gl, ge) = (rng.vec(n, 1.0), rng.vec(n, 0.3));
    let grads = logp_grads(
        &p,
        &float(gl.clone(), [n], device, DType::F32),
        &float(ge.clone(), [n], device, DType::F32),
    );
    let (h, w, b) = (
        values(p.hidden.clone()),
        values(p.weight.clone()),
        values(p.bias.clone().expect("bias")),
    );
    // dz = (g_lse − g_logp)·p + g_logp·onehot, ignored rows without the g_logp part.
    let mut dz = vec![0.0f64; n * v];
    for i in 0..n {
        let (_, lse, z) = logp_row_f64(
            &h[i * d..(i + 1) * d],
            &w,
            Some(&b),
            p.target_values[i],
            d,
            v,
        );
        let g_logp = if p.target_values[i] == IGNORE {
            0.0
        } else {
            gl[i] as f64
        };
        for j in 0..v {
            let prob = (z[j] - lse).exp();
            dz[i * v + j] = (ge[i] as f64 - g_logp) * prob
                + if p.target_values[i] == j as i64 {
                    g_logp
                } else {
                    0.0
                };
        }
    }
    let what = format!("linear_logp grads {dtype:?} {shape:?}");
    let (dh, dw, db) = (
        values(grads.hidden),
        values(grads.weight),
        values(grads.bias.expect("bias")),
    );
    let check = |name: &str, got: &[f64], exact: &[f64], scale: &[f64]| {
        for (idx, ((g, e), s)) in got.iter().zip(exact).zip(scale).enumerate() {
            // dz may be rounded to the input dtype before a tensor-core GEMM (Sm90), so the
            // error scales with Σ|dz·x| at that dtype's roundoff, plus the output rounding.
            let tol = 1e-4 * (1.0 + s) + 2.0 * unit_roundoff(dtype) * (s + e.abs());
            assert!(
                (g - e).abs() <= tol,
                "{what}: {name}[{idx}] {g} vs {e}, tol {tol:e}"
            );
        }
    };
    let mut exact_h = vec![0.0; n * d];
    let mut scale_h = vec![0.0; n * d];
    for i in 0..n {
        for j in 0..v {
            for k in 0..d {
                exact_h[i * d + k] += dz[i * v + j] * w[j * d + k];
                scale_h[i * d + k] += (dz[i * v + j] * w[j * d + k]).abs();
            }
        }
    }
    check("dHidden", &dh, &exact_h, &scale_h);
    let mut exact_w = vec![0.0; v * d];
    let mut scale_w = vec![0.0; v * d];
    let mut exact_b = vec![0.0; v];
    let mut scale_b = vec![0.0; v];
    for j in 0..v {
        for i in 0..n {
            exact_b[j] += dz[i * v + j];
            scale_b[j] += dz[i * v + j].abs();
            for k in 0..d {
                exact_w[j * d + k] += dz[i * v + j] * h[i * d + k];
                scale_w[j * d + k] += (dz[i * v + j] * h[i * d + k]).abs();
            }
        }
    }
    check("dWeight", &dw, &exact_w, &scale_w);
    check("dBias", &db, &exact_b, &scale_b);
}

// ---------------------------------------------------------------------------------------------
// Edge cases and bad input

pub fn empty_and_nan<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    // N = 0 returns an empty tensor.
    let p = logp_problem::<B>(device, dtype, [0, 7, 11], true, None, 71);
    let (logp, lse) = p.run();
    assert_eq!((logp.dims(), lse.dims()), ([0], [0]));
    let out = burn_invariant::matmul(
        float::<B, 2>(vec![], [0, 5], device, dtype),
        float(Rng::new(1).vec(15, 1.0), [5, 3], device, dtype),
    )
    .expect("empty matmul");
    assert_eq!(out.dims(), [0, 3]);
    // A NaN row propagates NaN to that row only; the other rows keep their bits.
    let p = logp_problem::<B>(device, dtype, [6, 9, 301], false, None, 72);
    let (clean_logp, _) = p.run();
    let mut h = values(p.hidden.clone());
    h[2 * 9 + 4] = f64::NAN;
    let poisoned = Logp {
        hidden: float(h.iter().map(|&x| x as f32).collect(), [6, 9], device, dtype),
        ..p.select(&(0..6).collect::<Vec<_>>())
    };
    let (logp, lse) = poisoned.run();
    let (logp, lse, clean) = (values(logp), values(lse), values(clean_logp));
    assert!(
        logp[2].is_nan() && lse[2].is_nan(),
        "NaN input must give NaN, got {} {}",
        logp[2],
        lse[2]
    );
    for i in [0, 1, 3, 4, 5] {
        assert_eq!(
            logp[i].to_bits(),
            clean[i].to_bits(),
            "row {i} changed by a NaN in row 2"
        );
    }
}

pub fn bad_input<B: InvariantBackend>(device: &B::Device, dtype: DType, other_dtype: DType) {
    let f = |shape: [usize; 2]| float::<B, 2>(vec![0.5; shape[0] * shape[1]], shape, device, dtype);
    let f1 = |n: usize| float::<B, 1>(vec![0.5; n], [n], device, dtype);
    let opts = LinearLogpOptions::default();
    // Inner dimension.
    let err = burn_invariant::matmul(f([3, 4]), f([5, 2])).unwrap_err();
    assert!(
        matches!(err, InvariantError::Shape { arg: "rhs", .. }),
        "{err}"
    );
    // Dtype mismatch.
    let other = float::<B, 2>(vec![0.5; 8], [4, 2], device, other_dtype);
    let err = burn_invariant::matmul(f([3, 4]), other).unwrap_err();
    assert!(
        matches!(err, InvariantError::DtypeMismatch { arg: "rhs", .. }),
        "{err}"
    );
    // linear: weight and bias shapes.
    let err = burn_invariant::linear(
        float::<B, 3>(vec![0.5; 24], [2, 3, 4], device, dtype),
        f([5, 2]),
        None,
    )
    .unwrap_err();
    assert!(
        matches!(err, InvariantError::Shape { arg: "weight", .. }),
        "{err}"
    );
    let err = burn_invariant::linear(f([3, 4]), f([4, 2]), Some(f1(3))).unwrap_err();
    assert!(
        matches!(err, InvariantError::Shape { arg: "bias", .. }),
        "{err}"
    );
    // 32-bit indexing limit on the output, caught before anything is allocated.
    let err = burn_invariant::matmul(f([70_000, 1]), f([1, 70_000])).unwrap_err();
    assert!(
        matches!(err, InvariantError::TooLarge { arg: "output", .. }),
        "{err}"
    );
    // linear_logp shapes.
    let t = |v: Vec<i64>| ints::<B>(v, device);
    let err = burn_invariant::linear_logp(f([3, 4]), f([7, 5]), t(vec![0, 1, 2]), None, &opts)
        .unwrap_err();
    assert!(
        matches!(err, InvariantError::Shape { arg: "weight", .. }),
        "{err}"
    );
    let err =
        burn_invariant::linear_logp(f([3, 4]), f([7, 4]), t(vec![0, 1]), None, &opts).unwrap_err();
    assert!(
        matches!(err, InvariantError::Shape { arg: "targets", .. }),
        "{err}"
    );
    let err =
        burn_invariant::linear_logp(f([3, 4]), f([7, 4]), t(vec![0, 1, 2]), Some(f1(6)), &opts)
            .unwrap_err();
    assert!(
        matches!(err, InvariantError::Shape { arg: "bias", .. }),
        "{err}"
    );
    let err = burn_invariant::linear_logp(f([3, 4]), f([0, 4]), t(vec![0, 1, 2]), None, &opts)
        .unwrap_err();
    assert!(
        matches!(err, InvariantError::Shape { arg: "weight", .. }),
        "{err}"
    );
    let other_w = float::<B, 2>(vec![0.5; 28], [7, 4], device, other_dtype);
    let err =
        burn_invariant::linear_logp(f([3, 4]), other_w, t(vec![0, 1, 2]), None, &opts).unwrap_err();
    assert!(
        matches!(err, InvariantError::DtypeMismatch { arg: "weight", .. }),
        "{err}"
    );
    let other_b = float::<B, 1>(vec![0.5; 7], [7], device, other_dtype);
    let err =
        burn_invariant::linear_logp(f([3, 4]), f([7, 4]), t(vec![0, 1, 2]), Some(other_b), &opts)
            .unwrap_err();
    assert!(
        matches!(err, InvariantError::DtypeMismatch { arg: "bias", .. }),
        "{err}"
    );
    // Targets out of range: the first offender and the count are named.
    let err = burn_invariant::linear_logp(f([4, 4]), f([7, 4]), t(vec![0, 7, -1, 3]), None, &opts)
        .unwrap_err();
    assert_eq!(
        err,
        InvariantError::TargetOutOfRange {
            index: 1,
            value: 7,
            vocab: 7,
            count: 2,
            ignore_index: None
        }
    );
    // The ignore index is accepted, other negatives are not.
    let ignore = LinearLogpOptions::default().with_ignore_index(-1);
    let logp = burn_invariant::linear_logp(f([3, 4]), f([7, 4]), t(vec![0, -1, 3]), None, &ignore)
        .expect("ignore_index");
    assert_eq!(values(logp)[1], 0.0);
    let err = burn_invariant::linear_logp(f([3, 4]), f([7, 4]), t(vec![0, -2, 3]), None, &ignore)
        .unwrap_err();
    assert!(
        matches!(
            err,
            InvariantError::TargetOutOfRange {
                index: 1,
                value: -2,
                ..
            }
        ),
        "{err}"
    );
    // Skipping the check: a bad target gives NaN for its row, never a crash.
    let skip = LinearLogpOptions::default().with_skip_target_check(true);
    let logp = values(
        burn_invariant::linear_logp(f([3, 4]), f([7, 4]), t(vec![0, 1000, 3]), None, &skip)
            .expect("unchecked"),
    );
    assert!(
        logp[1].is_nan() && logp[0].is_finite() && logp[2].is_finite(),
        "{logp:?}"
    );
}

/// Transposed and strided views through the public API have the bits of contiguous copies of
/// them: `matmul` of transposed operands; `linear` of a column slice with a bias sliced from a
/// longer vector; `linear_logp_full` with `hidden` a column slice of a wider tensor, `weight` a
/// transposed `[D, V]` and an offset bias. Slices start 256 elements in (512 bytes and more),
/// so the CubeCL backends keep them as views instead of copying them (they copy a slice whose
/// offset is not a multiple of the runtime's memory alignment). The copies are built from the
/// host values, not read back from the views: on CUDA, reading such views back left errors ("the
/// provided strides are not supported") that the rank threads of a later test met.
pub fn strided_views<B: InvariantBackend>(device: &B::Device, dtype: DType) {
    let mut rng = Rng::new(91);
    let tensor2 = |data: Vec<f32>, shape: [usize; 2]| float::<B, 2>(data, shape, device, dtype);
    let tensor1 = |data: Vec<f32>| {
        let n = data.len();
        float::<B, 1>(data, [n], device, dtype)
    };
    // `[rows, cols]` row-major → its transpose; its columns `range`.
    let transposed = |x: &[f32], rows: usize, cols: usize| -> Vec<f32> {
        (0..cols)
            .flat_map(|c| (0..rows).map(move |r| x[r * cols + c]))
            .collect()
    };
    let columns = |x: &[f32], cols: usize, range: std::ops::Range<usize>| -> Vec<f32> {
        x.chunks(cols)
            .flat_map(|row| row[range.clone()].to_vec())
            .collect()
    };
    let (m, k, n) = (37, 256, 29);
    let (lhs_h, rhs_h) = (rng.vec(k * m, 1.0), rng.vec(n * k, 1.0));
    let lhs = tensor2(lhs_h.clone(), [k, m]).transpose();
    let rhs = tensor2(rhs_h.clone(), [n, k]).transpose();
    let lhs_dense = tensor2(transposed(&lhs_h, k, m), [m, k]);
    let rhs_dense = || tensor2(transposed(&rhs_h, n, k), [k, n]);
    let got = burn_invariant::matmul(lhs, rhs.clone()).unwrap();
    let want = burn_invariant::matmul(lhs_dense, rhs_dense()).unwrap();
    assert_bits_eq("matmul of transposed views", &bits(got), &bits(want));

    let (wide_h, long_h) = (rng.vec(m * 3 * k, 1.0), rng.vec(n + 512, 1.0));
    let input = tensor2(wide_h.clone(), [m, 3 * k]).slice([0..m, k..2 * k]);
    let bias = tensor1(long_h.clone()).slice(256..256 + n);
    let got = burn_invariant::linear(input, rhs, Some(bias)).unwrap();
    let input = tensor2(columns(&wide_h, 3 * k, k..2 * k), [m, k]);
    let bias = tensor1(long_h[256..256 + n].to_vec());
    let want = burn_invariant::linear(input, rhs_dense(), Some(bias)).unwrap();
    assert_bits_eq("linear of a column slice", &bits(got), &bits(want));

    let (rows, d, v) = (23, 256, 301);
    let wide_h = rng.vec(rows * 3 * d, 1.0);
    let weight_h = rng.vec(d * v, 0.3);
    let long_h = rng.vec(v + 512, 1.0);
    let hidden = tensor2(wide_h.clone(), [rows, 3 * d]).slice([0..rows, d..2 * d]);
    let weight = tensor2(weight_h.clone(), [d, v]).transpose();
    let bias = tensor1(long_h.clone()).slice(256..256 + v);
    let targets: Vec<i64> = (0..rows).map(|i| (i * 37 % v) as i64).collect();
    let opts = LinearLogpOptions::default()
        .with_temperature(0.7)
        .with_entropy(true);
    let run = |h: Tensor<B, 2>, w: Tensor<B, 2>, b: Tensor<B, 1>| {
        let out = burn_invariant::linear_logp_full(
            h,
            w,
            ints::<B>(targets.clone(), device),
            Some(b),
            &opts,
        )
        .unwrap();
        [out.logp, out.lse, out.entropy.expect("requested")].map(bits)
    };
    let got = run(hidden, weight, bias);
    let want = run(
        tensor2(columns(&wide_h, 3 * d, d..2 * d), [rows, d]),
        tensor2(transposed(&weight_h, d, v), [v, d]),
        tensor1(long_h[256..256 + v].to_vec()),
    );
    for (name, (g, w)) in ["logp", "lse", "entropy"].iter().zip(got.iter().zip(&want)) {
        assert_bits_eq(&format!("linear_logp {name} of strided views"), g, w);
    }
}

// ---------------------------------------------------------------------------------------------
// The suite, one line per backend

/// Expands every suite into `#[test]`s: `invariant_testsuite!(Backend, AutodiffBackend,
/// setup_expr, dtypes: [..], other_dtype: ..)`. `setup_expr` yields `Option<Device>`; `None`
/// skips (the setup prints why). Tests are serial: they may share a GPU.
macro_rules! invariant_testsuite {
    ($backend:ty, $autodiff:ty, $setup:expr, dtypes: [$($dtype:expr),+], other_dtype: $other:expr) => {
        use serial_test::serial;

        fn device() -> Option<burn::tensor::Device<$backend>> {
            $setup
        }

        const DTYPES: &[burn::tensor::DType] = &[$($dtype),+];

        #[test]
        #[serial]
        fn matmul_row_invariance() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::matmul_row_invariance::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn matmul_backward_invariance() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::matmul_backward_invariance::<$autodiff>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn linear_logp_row_invariance() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::logp_row_invariance::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn linear_logp_backward_invariance() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::logp_backward_invariance::<$autodiff>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn attention_values_vs_f64() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::ops::attention_values::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn attention_decode_equals_prefill() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::ops::attention_decode_equals_prefill::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn attention_split_decode_equals_prefill() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::ops::attention_split_decode_equals_prefill::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn attention_batch_invariance() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::ops::attention_batch_invariance::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn attention_gradients_vs_f64() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::ops::attention_gradients::<$autodiff>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn attention_backward_invariance() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::ops::attention_backward_invariance::<$autodiff>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn attention_bad_input() {
            let Some(device) = device() else { return };
            common::ops::attention_bad_input::<$backend>(&device, DTYPES[0]);
            common::ops::attention_bad_input::<$autodiff>(&device, DTYPES[0]);
        }

        #[test]
        #[serial]
        fn rms_norm_values_and_row_invariance() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::ops::rms_norm_values::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn rms_norm_gradients_and_padding() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::ops::rms_norm_gradients::<$autodiff>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn whole_model_rollout_equals_trainer() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::model::whole_model::<$autodiff>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn rms_norm_bad_input() {
            let Some(device) = device() else { return };
            common::ops::rms_norm_bad_input::<$backend>(&device, DTYPES[0]);
            common::ops::rms_norm_bad_input::<$autodiff>(&device, DTYPES[0]);
        }

        #[test]
        #[serial]
        fn strided_views_equal_contiguous_copies() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::strided_views::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn matmul_correctness_fixed_shapes() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                for (i, shape) in [[1, 1, 1], [1, 97, 13], [33, 65, 17], [67, 129, 255], [7, 31, 1]].into_iter().enumerate() {
                    common::matmul_correctness::<$backend>(&device, dtype, shape, i % 2 == 0, 100 + i as u64);
                }
            }
        }

        #[test]
        #[serial]
        fn linear_logp_correctness_fixed_shapes() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                for (i, shape) in [[1, 1, 1], [1, 7, 2], [13, 67, 251], [5, 33, 1009], [3, 5, 50021]].into_iter().enumerate() {
                    common::logp_correctness::<$backend>(&device, dtype, shape, i % 2 == 1, 200 + i as u64);
                }
            }
        }

        #[test]
        #[serial]
        fn matmul_gradients_vs_f64() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::matmul_gradients_f64::<$autodiff>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn linear_logp_gradients_vs_f64() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::logp_gradients_f64::<$autodiff>(&device, dtype, [11, 13, 97]);
                common::logp_gradients_f64::<$autodiff>(&device, dtype, [2, 3, 50021]);
            }
        }

        #[test]
        #[serial]
        fn empty_and_nan_inputs() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::empty_and_nan::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn bad_input_errors() {
            let Some(device) = device() else { return };
            common::bad_input::<$backend>(&device, DTYPES[0], $other);
            common::bad_input::<$autodiff>(&device, DTYPES[0], $other);
        }

        #[test]
        #[serial]
        fn linear_logp_rl_head_correctness() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::rl_head::head_correctness::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn linear_logp_rl_head_row_invariance() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::rl_head::head_row_invariance::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn linear_logp_rl_head_gradients_vs_f64() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::rl_head::head_gradients_f64::<$autodiff>(&device, dtype, [7, 13, 97]);
                common::rl_head::head_gradients_f64::<$autodiff>(&device, dtype, [1, 3, 4099]);
            }
        }

        #[test]
        #[serial]
        fn linear_logp_rl_head_backward_invariance() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::rl_head::head_backward_invariance::<$autodiff>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn linear_logp_rl_head_masked_vocabulary() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::rl_head::head_masked_vocabulary::<$autodiff>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn linear_logp_unchecked_targets_give_nan() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::rl_head::unchecked_targets_give_nan::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn linear_sample_scores_are_linear_logp_full() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::sampler::sample_scores_are_linear_logp_full::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn rows_across_the_pass_bound() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::sampler::rows_across_pass_bound::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn linear_sample_row_invariance() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::sampler::sample_row_invariance::<$backend>(&device, dtype);
            }
            common::sampler::sample_row_invariance::<$autodiff>(&device, DTYPES[0]);
        }

        #[test]
        #[serial]
        fn linear_sample_greedy_is_argmax() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::sampler::sample_greedy_is_argmax::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn tp_linear_sample_greedy_and_top_k() {
            let Some(device) = device() else { return };
            for &dtype in DTYPES {
                common::sampler::tp_sample_ranked::<$backend>(&device, dtype);
            }
        }

        #[test]
        #[serial]
        fn linear_sample_bad_input() {
            let Some(device) = device() else { return };
            common::sampler::sample_bad_input::<$backend>(&device, DTYPES[0]);
            common::sampler::sample_bad_input::<$autodiff>(&device, DTYPES[0]);
        }

        #[test]
        #[serial]
        fn linear_logp_bad_temperature() {
            let Some(device) = device() else { return };
            common::rl_head::bad_temperature::<$backend>(&device, DTYPES[0]);
        }

        proptest::proptest! {
            #![proptest_config(proptest::prelude::ProptestConfig { cases: 12, failure_persistence: None, ..Default::default() })]

            #[test]
            #[serial]
            fn matmul_random_shapes(m in 1usize..48, k in 1usize..80, n in 1usize..48, bias: bool, seed: u64) {
                let Some(device) = device() else { return Ok(()) };
                for &dtype in DTYPES {
                    common::matmul_correctness::<$backend>(&device, dtype, [m, k, n], bias, seed);
                }
            }

            #[test]
            #[serial]
            fn linear_logp_random_shapes(n in 1usize..12, d in 1usize..40, v in 1usize..700, bias: bool, seed: u64) {
                let Some(device) = device() else { return Ok(()) };
                for &dtype in DTYPES {
                    common::logp_correctness::<$backend>(&device, dtype, [n, d, v], bias, seed);
                }
            }
        }
    };
}

/// Probes a device once; `None` (with a notice) when it is absent and not required.
pub fn probe<D: Clone + Send + Sync + 'static>(
    cell: &'static std::sync::OnceLock<Option<D>>,
    what: &str,
    require_env: &str,
    init: impl FnOnce() -> Option<D> + std::panic::UnwindSafe,
) -> Option<D> {
    cell.get_or_init(|| {
        let found = std::panic::catch_unwind(init).ok().flatten();
        if found.is_none() {
            if std::env::var(require_env).is_ok_and(|v| v == "1") {
                panic!("{what}: no device, and {require_env}=1 requires one");
            }
            eprintln!(
                "NOTICE: {what}: no device found, skipping (set {require_env}=1 to fail instead)"
            );
        }
        found
    })
    .clone()
}

/// CUDA device 0, probed once per test binary (`None`, with a notice, where no GPU or driver
/// exists, unless `BURN_INVARIANT_REQUIRE_CUDA=1`).
#[cfg(feature = "cuda")]
pub fn cuda_device() -> Option<burn_cuda::CudaDevice> {
    static CELL: std::sync::OnceLock<Option<burn_cuda::CudaDevice>> = std::sync::OnceLock::new();
    probe(&CELL, "cuda", "BURN_INVARIANT_REQUIRE_CUDA", || {
        // cudarc loads libcuda lazily and panics when it is absent.
        cudarc::driver::result::init().ok()?;
        let count = cudarc::driver::result::device::get_count().ok()?;
        (count > 0).then(|| burn_cuda::CudaDevice::new(0))
    })
}

/// HIP device 0, probed once per test binary (`None`, with a notice, where no AMD GPU or HIP
/// library exists, unless `BURN_INVARIANT_REQUIRE_ROCM=1`).
#[cfg(feature = "rocm")]
pub fn rocm_device() -> Option<cubecl::hip::AmdDevice> {
    static CELL: std::sync::OnceLock<Option<cubecl::hip::AmdDevice>> = std::sync::OnceLock::new();
    probe(&CELL, "rocm", "BURN_INVARIANT_REQUIRE_ROCM", || {
        // cubecl's HIP server aborts the process where HIP's library or a GPU is missing, so
        // both are asked first.
        if !cubecl_hip_sys::is_available() {
            return None;
        }
        let mut count = 0;
        // SAFETY: writes one int.
        let status = unsafe { cubecl_hip_sys::hipGetDeviceCount(&mut count) };
        (status == cubecl_hip_sys::hipError_t_hipSuccess && count > 0)
            .then(|| cubecl::hip::AmdDevice::new(0))
    })
}

/// The default wgpu device, probed once per test binary (`None`, with a notice, where no adapter
/// exists, unless `BURN_INVARIANT_REQUIRE_WGPU=1`).
#[cfg(feature = "wgpu")]
pub fn wgpu_device() -> Option<burn_wgpu::WgpuDevice> {
    static CELL: std::sync::OnceLock<Option<burn_wgpu::WgpuDevice>> = std::sync::OnceLock::new();
    probe(&CELL, "wgpu", "BURN_INVARIANT_REQUIRE_WGPU", || {
        let device = burn_wgpu::WgpuDevice::DefaultDevice;
        // Creating the client panics when no adapter exists.
        let _ = <burn_wgpu::WgpuRuntime as cubecl::Runtime>::client(&device);
        Some(device)
    })
}

/// Runs the ignored test `name` of this test binary alone in a child process (for what changes
/// the process for good: an environment read once, a device marked failed), with `set` and
/// `remove` applied to its environment, and asserts that it passed.
#[allow(dead_code)] // not every test binary uses it
pub fn run_ignored_in_child(name: &str, set: &[(&str, &str)], remove: &[&str]) {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap());
    child.args(["--exact", name, "--ignored", "--nocapture"]);
    for (key, value) in set {
        child.env(key, value);
    }
    for key in remove {
        child.env_remove(key);
    }
    let out = child.output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("1 passed"), "{text}");
}
