//! linear_logp forward/backward tests (wgpu; CUDA too with `--features cuda`).

mod common;

use burn_invariant_cubecl::logp::{
    SampleSpec, linear_sample_forward, linear_sample_workspace_len, linear_top_k_forward,
};
use burn_invariant_cubecl::{
    KernelError, LogpGradRefs, LogpInputRefs, linear_logp_backward,
    linear_logp_backward_workspace_len, linear_logp_forward, linear_logp_forward_workspace_len,
};
use common::*;
use cubecl::prelude::*;

const IGN: i64 = -100;

struct Problem {
    n: usize,
    d: usize,
    v: usize,
    dt: Dt,
    hidden: Vec<f32>,
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    targets: Vec<i32>,
}

impl Problem {
    fn new(seed: u64, n: usize, d: usize, v: usize, dt: Dt, with_bias: bool) -> Self {
        let hidden = rand_vec(seed, n * d, dt)
            .iter()
            .map(|x| dt.round(x * 2.0))
            .collect();
        let weight = rand_vec(seed + 1, v * d, dt);
        let bias = with_bias.then(|| rand_vec(seed + 2, v, dt));
        let tr = rand_vec(seed + 3, n, Dt::F32);
        let targets = (0..n)
            .map(|i| match i % 11 {
                3 => IGN as i32,
                7 if i > 10 => v as i32 + 5, // invalid: NaN logp, no OOB
                _ => (((tr[i] + 1.0) * 0.5 * v as f32) as i32).clamp(0, v as i32 - 1),
            })
            .collect();
        Problem {
            n,
            d,
            v,
            dt,
            hidden,
            weight,
            bias,
            targets,
        }
    }

    fn rows(&self, s: usize, e: usize) -> Problem {
        Problem {
            n: e - s,
            d: self.d,
            v: self.v,
            dt: self.dt,
            hidden: self.hidden[s * self.d..e * self.d].to_vec(),
            weight: self.weight.clone(),
            bias: self.bias.clone(),
            targets: self.targets[s..e].to_vec(),
        }
    }

    /// f64 logits of row i.
    fn z(&self, i: usize) -> Vec<f64> {
        (0..self.v)
            .map(|j| {
                let mut acc = 0.0f64;
                for p in 0..self.d {
                    acc += self.hidden[i * self.d + p] as f64 * self.weight[j * self.d + p] as f64;
                }
                acc + self.bias.as_ref().map_or(0.0, |b| b[j] as f64)
            })
            .collect()
    }

    fn lse(z: &[f64]) -> f64 {
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
    }
}

struct Dev<R: Runtime> {
    hidden: Buf<R>,
    weight: Buf<R>,
    bias: Option<Buf<R>>,
    targets: Buf<R>,
}

fn upload_problem<R: Runtime>(client: &ComputeClient<R>, p: &Problem) -> Dev<R> {
    Dev {
        hidden: upload(client, &p.hidden, &[p.n, p.d], p.dt),
        weight: upload(client, &p.weight, &[p.v, p.d], p.dt),
        bias: p.bias.as_ref().map(|b| upload(client, b, &[p.v], p.dt)),
        targets: upload_i32(client, &p.targets),
    }
}

fn inputs<'a, R: Runtime>(dev: &'a Dev<R>, p: &Problem) -> LogpInputRefs<'a, R> {
    LogpInputRefs {
        hidden: dev.hidden.b(),
        weight: dev.weight.b(),
        bias: dev.bias.as_ref().map(|b| b.b()),
        targets: dev.targets.b(),
        targets_dtype: i32_storage(),
        ignore_index: Some(IGN),
        dtype: p.dt.storage(),
        inv_temperature: 1.0,
        entropy: false,
    }
}

fn forward<R: Runtime>(client: &ComputeClient<R>, p: &Problem) -> (Vec<f32>, Vec<f32>) {
    let dev = upload_problem(client, p);
    let stats = alloc_dense(client, &[p.n, 2], Dt::F32);
    let ws = alloc_dense(
        client,
        &[linear_logp_forward_workspace_len(p.n, p.v, p.dt.storage()).max(1)],
        Dt::F32,
    );
    linear_logp_forward(client, &inputs(&dev, p), stats.b(), ws.b()).expect("forward");
    let s = read_2d(client, &stats, Dt::F32, p.n, 2);
    (
        s.iter().step_by(2).copied().collect(),
        s.iter().skip(1).step_by(2).copied().collect(),
    )
}

struct Grads {
    dh: Vec<f32>,
    dw: Vec<f32>,
    db: Option<Vec<f32>>,
}

fn backward<R: Runtime>(client: &ComputeClient<R>, p: &Problem, g: &[f32]) -> Grads {
    let dev = upload_problem(client, p);
    let inp = inputs(&dev, p);
    let stats = alloc_dense(client, &[p.n, 2], Dt::F32);
    let ws = alloc_dense(
        client,
        &[linear_logp_forward_workspace_len(p.n, p.v, p.dt.storage()).max(1)],
        Dt::F32,
    );
    linear_logp_forward(client, &inp, stats.b(), ws.b()).expect("forward");
    let grad = upload(client, g, &[p.n, 2], Dt::F32);
    let dh = alloc_dense(client, &[p.n, p.d], p.dt);
    let dw = alloc_dense(client, &[p.v, p.d], p.dt);
    let db = p.bias.as_ref().map(|_| alloc_dense(client, &[p.v], p.dt));
    let wl = linear_logp_backward_workspace_len(p.n, p.d, p.v, p.dt.storage(), p.bias.is_some())
        .unwrap();
    let ws = alloc_dense(client, &[wl.max(1)], Dt::F32);
    linear_logp_backward(
        client,
        &inp,
        stats.b(),
        grad.b(),
        &LogpGradRefs {
            d_hidden: dh.b(),
            d_weight: dw.b(),
            d_bias: db.as_ref().map(|b| b.b()),
        },
        ws.b(),
    )
    .expect("backward");
    Grads {
        dh: read_2d(client, &dh, p.dt, p.n, p.d),
        dw: read_2d(client, &dw, p.dt, p.v, p.d),
        db: db.map(|b| read_2d(client, &b, p.dt, p.v, 1)),
    }
}

fn check_forward<R: Runtime>(client: &ComputeClient<R>, p: &Problem) {
    let (logp, lse) = forward(client, p);
    for i in 0..p.n {
        let z = p.z(i);
        let l = Problem::lse(&z);
        let scale: f64 = (0..p.d)
            .map(|q| p.hidden[i * p.d + q].abs() as f64)
            .sum::<f64>()
            + 1.0;
        let tol = 2e-5 * scale * (1.0 + l.abs()).max(1.0);
        assert!(
            (lse[i] as f64 - l).abs() <= tol,
            "lse row {i}: got {} want {l}",
            lse[i]
        );
        let t = p.targets[i] as i64;
        if t == IGN {
            assert_eq!(logp[i].to_bits(), 0.0f32.to_bits(), "ignored row {i} logp");
        } else if t < 0 || t >= p.v as i64 {
            assert!(logp[i].is_nan(), "invalid target row {i}: logp {}", logp[i]);
        } else {
            let want = z[t as usize] - l;
            assert!(
                (logp[i] as f64 - want).abs() <= tol,
                "logp row {i}: got {} want {want}",
                logp[i]
            );
        }
    }
    eprintln!(
        "[{}] linear_logp forward {:?} N={} D={} V={} bias={}: vs f64 PASS",
        runtime_name(client),
        p.dt,
        p.n,
        p.d,
        p.v,
        p.bias.is_some()
    );
}

fn forward_invariance<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    let p = Problem::new(5, 67, 33, 1009, dt, true);
    let (lp, ls) = forward(client, &p);
    let (lp2, ls2) = forward(client, &p);
    assert_eq!(bits(&lp), bits(&lp2), "rerun logp");
    assert_eq!(bits(&ls), bits(&ls2), "rerun lse");
    for &i in &[0usize, 2, 63, 64, 66] {
        let (a, b) = forward(client, &p.rows(i, i + 1));
        assert_eq!(a[0].to_bits(), lp[i].to_bits(), "row {i} alone logp");
        assert_eq!(b[0].to_bits(), ls[i].to_bits(), "row {i} alone lse");
    }
    let mut cl = Vec::new();
    let mut cs = Vec::new();
    for (s, e) in [(0usize, 9usize), (9, 40), (40, 67)] {
        let (a, b) = forward(client, &p.rows(s, e));
        cl.extend(a);
        cs.extend(b);
    }
    assert_eq!(bits(&cl), bits(&lp), "chunked logp");
    assert_eq!(bits(&cs), bits(&ls), "chunked lse");
    let mut pp = Problem::new(5, 67, 33, 1009, dt, true);
    pp.hidden
        .extend(rand_vec(99, 70 * p.d, dt).iter().map(|x| dt.round(x * 8.0)));
    pp.targets.extend((0..70).map(|i| (i * 13) % 1009));
    pp.n += 70;
    let (a, b) = forward(client, &pp);
    assert_eq!(bits(&a[..67]), bits(&lp), "padded logp");
    assert_eq!(bits(&b[..67]), bits(&ls), "padded lse");
    eprintln!(
        "[{}] linear_logp forward {dt:?}: bitwise row invariance (alone/chunked/padded) + rerun PASS",
        runtime_name(client)
    );
}

fn check_backward<R: Runtime>(client: &ComputeClient<R>, p: &Problem) {
    let gr = rand_vec(1234, p.n * 2, Dt::F32);
    let got = backward(client, p, &gr);
    // f64 analytic gradient.
    let mut dz = vec![0.0f64; p.n * p.v];
    for i in 0..p.n {
        let z = p.z(i);
        let l = Problem::lse(&z);
        let t = p.targets[i] as i64;
        let gl = if t == IGN { 0.0 } else { gr[2 * i] as f64 };
        let gs = gr[2 * i + 1] as f64;
        for j in 0..p.v {
            let pj = (z[j] - l).exp();
            let ind = if t == j as i64 { 1.0 } else { 0.0 };
            dz[i * p.v + j] = gl * (ind - pj) + gs * pj;
        }
    }
    let out_eps = match p.dt {
        Dt::F32 => 0.0,
        Dt::F16 => 1.0 / 1024.0,
        Dt::BF16 => 1.0 / 128.0,
    };
    // The tensor-core path rounds dz once to the input dtype before its GEMMs (as Sm90 does):
    // a relative error of the dtype's epsilon, and for f16 an absolute one of half its smallest
    // subnormal (2^-25) per term, times the other operand.
    let dz_eps = out_eps;
    let dz_abs = if p.dt == Dt::F16 { 2f64.powi(-25) } else { 0.0 };
    let check = |what: &str, got: &[f32], want: &[f64], mag: &[f64], other: &[f64]| {
        for k in 0..want.len() {
            let tol = (1e-4 + dz_eps) * mag[k] + dz_abs * other[k] + out_eps * want[k].abs() + 1e-7;
            assert!(
                (got[k] as f64 - want[k]).abs() <= tol,
                "{what}[{k}]: got {} want {} (tol {tol:e})",
                got[k],
                want[k]
            );
        }
    };
    let (mut wdh, mut mdh) = (vec![0.0; p.n * p.d], vec![0.0; p.n * p.d]);
    let (mut wdw, mut mdw) = (vec![0.0; p.v * p.d], vec![0.0; p.v * p.d]);
    let (mut wdb, mut mdb) = (vec![0.0; p.v], vec![0.0; p.v]);
    for i in 0..p.n {
        for j in 0..p.v {
            let g = dz[i * p.v + j];
            for q in 0..p.d {
                let w = p.weight[j * p.d + q] as f64;
                let h = p.hidden[i * p.d + q] as f64;
                wdh[i * p.d + q] += g * w;
                mdh[i * p.d + q] += (g * w).abs();
                wdw[j * p.d + q] += g * h;
                mdw[j * p.d + q] += (g * h).abs();
            }
            wdb[j] += g;
            mdb[j] += g.abs();
        }
    }
    // Σ|w[j, q]| over j (for dHidden) and Σ|h[i, q]| over i (for dWeight).
    let mut sw = vec![0.0f64; p.d];
    let mut sh = vec![0.0f64; p.d];
    for q in 0..p.d {
        sw[q] = (0..p.v).map(|j| p.weight[j * p.d + q].abs() as f64).sum();
        sh[q] = (0..p.n).map(|i| p.hidden[i * p.d + q].abs() as f64).sum();
    }
    let per_col =
        |s: &[f64], rows: usize| -> Vec<f64> { (0..rows * p.d).map(|k| s[k % p.d]).collect() };
    check("dHidden", &got.dh, &wdh, &mdh, &per_col(&sw, p.n));
    check("dWeight", &got.dw, &wdw, &mdw, &per_col(&sh, p.v));
    if let Some(db) = &got.db {
        check("dBias", db, &wdb, &mdb, &vec![0.0; p.v]);
    }
    eprintln!(
        "[{}] linear_logp backward {:?} N={} D={} V={} bias={}: vs f64 analytic gradient PASS",
        runtime_name(client),
        p.dt,
        p.n,
        p.d,
        p.v,
        p.bias.is_some()
    );
}

fn backward_invariance<R: Runtime>(client: &ComputeClient<R>, dt: Dt) {
    let p = Problem::new(8, 67, 19, 1009, dt, true);
    let gr = rand_vec(4321, p.n * 2, Dt::F32);
    let full = backward(client, &p, &gr);
    let again = backward(client, &p, &gr);
    assert_eq!(bits(&full.dh), bits(&again.dh), "rerun dH");
    assert_eq!(bits(&full.dw), bits(&again.dw), "rerun dW");
    assert_eq!(
        bits(full.db.as_ref().unwrap()),
        bits(again.db.as_ref().unwrap()),
        "rerun dB"
    );
    // dHidden rows: alone and chunked.
    for &i in &[0usize, 3, 64, 66] {
        let g = backward(client, &p.rows(i, i + 1), &gr[2 * i..2 * i + 2]);
        assert_eq!(
            bits(&g.dh),
            bits(&full.dh[i * p.d..(i + 1) * p.d]),
            "dH row {i} alone"
        );
    }
    let mut ch = Vec::new();
    for (s, e) in [(0usize, 30usize), (30, 67)] {
        ch.extend(backward(client, &p.rows(s, e), &gr[2 * s..2 * e]).dh);
    }
    assert_eq!(bits(&ch), bits(&full.dh), "dH chunked");
    // dWeight / dBias: appended rows with zero upstream gradient (hidden garbage incl. NaN/Inf).
    let mut pp = Problem::new(8, 67, 19, 1009, dt, true);
    let extra = 45;
    for r in 0..extra {
        for q in 0..p.d {
            pp.hidden.push(match (r * 7 + q) % 5 {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => dt.round(60.0),
                _ => dt.round(-0.25),
            });
        }
        pp.targets.push(if r % 3 == 0 {
            IGN as i32
        } else {
            (r * 17) as i32
        });
    }
    pp.n += extra;
    let mut gp = gr.clone();
    gp.extend(std::iter::repeat_n(0.0f32, extra * 2));
    let padded = backward(client, &pp, &gp);
    assert_eq!(
        bits(&padded.dw),
        bits(&full.dw),
        "dW with zero-grad rows appended"
    );
    assert_eq!(
        bits(padded.db.as_ref().unwrap()),
        bits(full.db.as_ref().unwrap()),
        "dB with zero-grad rows appended"
    );
    assert_eq!(
        bits(&padded.dh[..67 * p.d]),
        bits(&full.dh),
        "dH with rows appended"
    );
    eprintln!(
        "[{}] linear_logp backward {dt:?}: rerun, dH row invariance, dW/dB zero-grad padding invariance (bitwise) PASS",
        runtime_name(client)
    );
}

fn errors<R: Runtime>(client: &ComputeClient<R>) {
    let p = Problem::new(1, 5, 7, 11, Dt::F32, true);
    let dev = upload_problem(client, &p);
    let stats = alloc_dense(client, &[p.n, 2], Dt::F32);
    let ws = alloc_dense(
        client,
        &[linear_logp_forward_workspace_len(p.n, p.v, p.dt.storage())],
        Dt::F32,
    );
    // Workspace too small.
    let small = alloc_dense(client, &[3], Dt::F32);
    let e = linear_logp_forward(client, &inputs(&dev, &p), stats.b(), small.b()).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::BufferTooSmall {
                arg: "workspace",
                ..
            }
        ),
        "{e}"
    );
    eprintln!("error (workspace): {e}");
    // Targets length.
    let t4 = upload_i32(client, &[0, 1, 2, 3]);
    let mut inp = inputs(&dev, &p);
    inp.targets = t4.b();
    let e = linear_logp_forward(client, &inp, stats.b(), ws.b()).unwrap_err();
    assert!(
        matches!(e, KernelError::Shape { arg: "targets", .. }),
        "{e}"
    );
    eprintln!("error (targets): {e}");
    // Weight inner dim.
    let w_bad = upload(client, &rand_vec(3, 11 * 6, Dt::F32), &[11, 6], Dt::F32);
    let mut inp = inputs(&dev, &p);
    inp.weight = w_bad.b();
    let e = linear_logp_forward(client, &inp, stats.b(), ws.b()).unwrap_err();
    assert!(matches!(e, KernelError::Shape { arg: "weight", .. }), "{e}");
    // Float targets dtype.
    let mut inp = inputs(&dev, &p);
    inp.targets_dtype = Dt::F32.storage();
    let e = linear_logp_forward(client, &inp, stats.b(), ws.b()).unwrap_err();
    assert!(
        matches!(e, KernelError::UnsupportedDtype { arg: "targets", .. }),
        "{e}"
    );
    // Stats shape.
    let bad_stats = alloc_dense(client, &[p.n, 3], Dt::F32);
    let e = linear_logp_forward(client, &inputs(&dev, &p), bad_stats.b(), ws.b()).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::Shape {
                arg: "stats_out",
                ..
            }
        ),
        "{e}"
    );
    // bf16 where unsupported.
    if !burn_invariant_cubecl::runtime_supports(client, Dt::BF16.storage()) {
        let mut inp = inputs(&dev, &p);
        inp.dtype = Dt::BF16.storage();
        let e = linear_logp_forward(client, &inp, stats.b(), ws.b()).unwrap_err();
        assert!(
            matches!(e, KernelError::DtypeNotSupportedByRuntime { .. }),
            "{e}"
        );
        eprintln!("error (bf16): {e}");
    }
    // Backward: missing d_bias.
    linear_logp_forward(client, &inputs(&dev, &p), stats.b(), ws.b()).unwrap();
    let g = upload(client, &rand_vec(9, p.n * 2, Dt::F32), &[p.n, 2], Dt::F32);
    let dh = alloc_dense(client, &[p.n, p.d], Dt::F32);
    let dw = alloc_dense(client, &[p.v, p.d], Dt::F32);
    let wl = linear_logp_backward_workspace_len(p.n, p.d, p.v, Dt::F32.storage(), true).unwrap();
    let bws = alloc_dense(client, &[wl], Dt::F32);
    let e = linear_logp_backward(
        client,
        &inputs(&dev, &p),
        stats.b(),
        g.b(),
        &LogpGradRefs {
            d_hidden: dh.b(),
            d_weight: dw.b(),
            d_bias: None,
        },
        bws.b(),
    )
    .unwrap_err();
    assert!(matches!(e, KernelError::Shape { arg: "d_bias", .. }), "{e}");
    eprintln!("error (d_bias): {e}");
    // i64 targets: run where supported, clear error otherwise.
    let t64: Vec<i64> = p
        .targets
        .iter()
        .map(|&t| if t == IGN as i32 { IGN } else { t as i64 })
        .collect();
    let tb = upload_i64(client, &t64);
    let mut inp = inputs(&dev, &p);
    inp.targets = tb.b();
    inp.targets_dtype = i64_storage();
    match linear_logp_forward(client, &inp, stats.b(), ws.b()) {
        Ok(()) => {
            let s64 = read_2d(client, &stats, Dt::F32, p.n, 2);
            linear_logp_forward(client, &inputs(&dev, &p), stats.b(), ws.b()).unwrap();
            let s32 = read_2d(client, &stats, Dt::F32, p.n, 2);
            assert_eq!(bits(&s64), bits(&s32), "i64 targets == i32 targets");
            eprintln!("[{}] i64 targets supported: PASS", runtime_name(client));
        }
        Err(e) => {
            assert!(
                matches!(
                    e,
                    KernelError::DtypeNotSupportedByRuntime { arg: "targets", .. }
                ),
                "{e}"
            );
            eprintln!("error (i64 targets): {e}");
        }
    }
    // N = 0: backward zero-fills dWeight and dBias.
    let p0 = Problem::new(1, 0, 7, 11, Dt::F32, true);
    let g0 = backward(client, &p0, &[]);
    assert!(g0.dw.iter().all(|x| x.to_bits() == 0), "dW zero for N = 0");
    assert!(
        g0.db.unwrap().iter().all(|x| x.to_bits() == 0),
        "dB zero for N = 0"
    );
    eprintln!(
        "[{}] linear_logp error cases + N=0: PASS",
        runtime_name(client)
    );
}

/// The vocabulary rows `[s, e)` of `p` (and their bias) as a problem of their own.
fn columns(p: &Problem, s: usize, e: usize) -> Problem {
    Problem {
        v: e - s,
        weight: p.weight[s * p.d..e * p.d].to_vec(),
        bias: p.bias.as_ref().map(|b| b[s..e].to_vec()),
        hidden: p.hidden.clone(),
        targets: p.targets.clone(),
        ..*p
    }
}

/// `linear_top_k_forward` at temperature 1/2: `[N, 2k]` host values.
fn top_k<R: Runtime>(client: &ComputeClient<R>, p: &Problem, k: u32) -> Vec<f32> {
    let dev = upload_problem(client, p);
    let inputs = LogpInputRefs {
        ignore_index: None,
        inv_temperature: 0.5,
        ..inputs(&dev, p)
    };
    let kk = 2 * k as usize;
    let out = alloc_dense(client, &[p.n, kk], Dt::F32);
    let len = linear_sample_workspace_len(p.n, p.v, p.dt.storage(), k);
    let ws = alloc_dense(client, &[len.max(1)], Dt::F32);
    linear_top_k_forward(client, &inputs, k, out.b(), ws.b()).expect("top-k");
    read_2d(client, &out, Dt::F32, p.n, kk)
}

/// The top-k lists: sorted (larger logit, then smaller column), the `k` largest logits within
/// f32 rounding of the f64 ones, the lists of two vocabulary shards merged on the host bitwise
/// the whole's, and top-1 the greedy sampler's token.
fn check_top_k<R: Runtime>(client: &ComputeClient<R>, p: &Problem, k: u32, cut: usize) {
    let kk = k as usize;
    let what = format!("top-{k} {:?} [{}, {}, {}]", p.dt, p.n, p.d, p.v);
    let whole = top_k(client, p, k);
    let (left, right) = (
        top_k(client, &columns(p, 0, cut), k),
        top_k(client, &columns(p, cut, p.v), k),
    );
    let tol = match p.dt {
        Dt::F32 => 1e-4,
        _ => 1e-2,
    };
    for i in 0..p.n {
        let row = |o: &[f32]| o[i * 2 * kk..(i + 1) * 2 * kk].to_vec();
        let got = row(&whole);
        let z64: Vec<f64> = p.z(i).iter().map(|z| z * 0.5).collect();
        let mut sorted = z64.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        for e in 0..kk {
            let (z, j) = (got[e], got[kk + e] as usize);
            assert!(j < p.v, "{what} row {i} slot {e}: column {}", got[kk + e]);
            assert!(
                (z as f64 - z64[j]).abs() <= tol * (1.0 + z64[j].abs()),
                "{what} row {i} slot {e}: z {z} vs {}",
                z64[j]
            );
            assert!(
                z as f64 >= sorted[e] - 2.0 * tol * (1.0 + sorted[e].abs()),
                "{what} row {i} slot {e}: z {z} below the f64 rank {}",
                sorted[e]
            );
            if e > 0 {
                let (pz, pj) = (got[e - 1], got[kk + e - 1]);
                assert!(
                    pz > z || (pz == z && pj < got[kk + e]),
                    "{what} row {i}: unsorted at {e}"
                );
            }
        }
        // The shards' lists, merged under the same order, are the whole's, bitwise.
        let mut merged: Vec<(f32, usize)> = Vec::new();
        for (list, start) in [(row(&left), 0), (row(&right), cut)] {
            for e in 0..kk {
                if list[kk + e] >= 0.0 {
                    merged.push((list[e], list[kk + e] as usize + start));
                }
            }
        }
        merged.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let want: Vec<(u32, usize)> = merged[..kk]
            .iter()
            .map(|&(z, j)| (z.to_bits(), j))
            .collect();
        let have: Vec<(u32, usize)> = (0..kk)
            .map(|e| (got[e].to_bits(), got[kk + e] as usize))
            .collect();
        assert_eq!(
            have, want,
            "{what} row {i}: shards [0, {cut}) + [{cut}, V) merged"
        );
    }
    if k == 1 {
        let dev = upload_problem(client, p);
        let inputs = LogpInputRefs {
            ignore_index: None,
            inv_temperature: 0.5,
            ..inputs(&dev, p)
        };
        let out = alloc_dense(client, &[p.n, 3], Dt::F32);
        let spec = SampleSpec {
            seed: 1,
            k: 1,
            noise: false,
        };
        let len = linear_sample_workspace_len(p.n, p.v, p.dt.storage(), 1);
        let ws = alloc_dense(client, &[len], Dt::F32);
        linear_sample_forward(client, &inputs, spec, out.b(), ws.b()).expect("greedy");
        let greedy = read_2d(client, &out, Dt::F32, p.n, 3);
        for i in 0..p.n {
            assert_eq!(
                whole[i * 2 + 1],
                greedy[i * 3 + 2],
                "{what} row {i}: top-1 vs greedy"
            );
        }
    }
}

fn suite<R: Runtime>(client: &ComputeClient<R>, dts: &[Dt]) {
    for &dt in dts {
        check_forward(client, &Problem::new(1, 7, 31, 1009, dt, true));
        check_forward(client, &Problem::new(2, 23, 17, 1009, dt, false));
        check_forward(client, &Problem::new(3, 3, 17, 50021, dt, true));
        forward_invariance(client, dt);
        check_backward(client, &Problem::new(4, 7, 31, 1009, dt, true));
        backward_invariance(client, dt);
        for k in [1, 5, 64] {
            check_top_k(client, &Problem::new(11, 9, 19, 5003, dt, true), k, 1234);
        }
    }
    // Crosses the backward row (256) and vocab (4096) chunks and several forward segments.
    check_backward(client, &Problem::new(6, 300, 9, 5003, Dt::F32, true));
    check_forward(client, &Problem::new(7, 300, 9, 9001, Dt::F32, false));
    errors(client);
}

#[test]
fn logp_wgpu() {
    with_wgpu("logp_wgpu", |client| suite(client, &[Dt::F32, Dt::F16]));
}

/// The tensor-core path's chunk loops, scan and `dz` kernels, with FMA GEMMs (lavapipe has no
/// cooperative matrices): the f16 suite, plus shapes crossing the row and vocabulary chunks.
#[test]
fn logp_chunked_fma_wgpu() {
    burn_invariant_cubecl::with_chunked_fma(|| {
        with_wgpu("logp_chunked_fma_wgpu", |client| {
            suite(client, &[Dt::F16]);
            check_forward(client, &Problem::new(9, 2100, 9, 9001, Dt::F16, true));
            check_backward(client, &Problem::new(10, 2100, 9, 4500, Dt::F16, true));
        })
    });
}

#[cfg(feature = "cuda")]
#[test]
fn logp_cuda() {
    with_cuda(|client| suite(client, &[Dt::F32, Dt::F16, Dt::BF16]));
}
