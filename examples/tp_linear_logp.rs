//! Vocabulary-sharded (tensor-parallel) `linear_logp`: shard an LM head over `world` ranks,
//! one CPU thread per rank with the in-process group, run forward + backward, and check
//!  - TP-size invariance: logp, lse and dHidden bitwise equal to the world-1 TP run (when the
//!    world size divides 8, so the shards fall on segment boundaries);
//!  - agreement with the single-rank `linear_logp` within rounding.
//!
//! `cargo run --release --example tp_linear_logp -- [world] [tokens] [hidden] [vocab]`
//! (defaults 4, 64, 128, 8192). CPU (NdArray reference) only for now; multi-GPU runs need the
//! NCCL group.
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::{Int, Tensor, TensorData};
use burn_invariant::tp::{self, InProcessGroup, VocabShard};
use burn_invariant::{LinearLogpOptions, linear_logp_with_lse};

type Inner = burn::backend::NdArray<f32>;
type Train = burn::backend::Autodiff<Inner>;

const PAD: i64 = -100;

struct Data {
    n: usize,
    d: usize,
    v: usize,
    hidden: Vec<f32>,
    weight: Vec<f32>,
    bias: Vec<f32>,
    targets: Vec<i64>,
}

/// logp, lse, dHidden (rank 0's; every rank has the same), timings.
struct Run {
    logp: Vec<f32>,
    lse: Vec<f32>,
    dhidden: Vec<f32>,
    forward: Duration,
    backward: Duration,
}

fn data(n: usize, d: usize, v: usize) -> Data {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let scale = 3.0 / (d as f32).sqrt();
    let hidden = (0..n * d).map(|_| uniform()).collect();
    let weight = (0..v * d).map(|_| uniform() * scale).collect();
    let bias = (0..v).map(|_| uniform()).collect();
    let targets = (0..n)
        .map(|i| {
            if i % 7 == 6 {
                PAD
            } else {
                ((uniform() * 0.5 + 0.5) * v as f32) as i64 % v as i64
            }
        })
        .collect();
    Data {
        n,
        d,
        v,
        hidden,
        weight,
        bias,
        targets,
    }
}

fn tensor<const D: usize>(values: Vec<f32>, shape: [usize; D]) -> Tensor<Train, D> {
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

fn targets(data: &Data) -> Tensor<Train, 1, Int> {
    Tensor::from_data(
        TensorData::new(data.targets.clone(), [data.n]),
        &Default::default(),
    )
}

fn host<const D: usize>(t: Tensor<Inner, D>) -> Vec<f32> {
    t.into_data().to_vec().expect("f32 data")
}

/// Upstream gradients: `Σ logp + 0.1·Σ lse` (a z-loss-like term exercises dLse).
fn loss(logp: Tensor<Train, 1>, lse: Tensor<Train, 1>) -> Tensor<Train, 1> {
    logp.sum() + lse.sum() * 0.1
}

fn run_tp(data: &Arc<Data>, world: usize) -> Run {
    let groups = InProcessGroup::new(world);
    let threads: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(rank, group)| {
            let data = data.clone();
            std::thread::spawn(move || {
                let shard = VocabShard::split(rank, world, data.v);
                let rows = shard.range();
                let hidden = tensor(data.hidden.clone(), [data.n, data.d]).require_grad();
                let weight = tensor(
                    data.weight[rows.start * data.d..rows.end * data.d].to_vec(),
                    [shard.len(), data.d],
                )
                .require_grad();
                let bias = tensor(data.bias[rows].to_vec(), [shard.len()]).require_grad();
                let options = LinearLogpOptions::default().with_ignore_index(PAD);
                let start = Instant::now();
                let (logp, lse) = tp::linear_logp_with_lse(
                    hidden.clone(),
                    weight.clone(),
                    targets(&data),
                    Some(bias.clone()),
                    &shard,
                    &group,
                    &options,
                )
                .expect("tp::linear_logp_with_lse");
                let (logp_host, lse_host) = (host(logp.clone().inner()), host(lse.clone().inner()));
                let forward = start.elapsed();
                let start = Instant::now();
                let grads = loss(logp, lse).backward();
                let dhidden = host(hidden.grad(&grads).expect("dHidden"));
                // dWeight/dBias of this shard, materialized so the timing includes them.
                let _ = host(weight.grad(&grads).expect("dWeight"));
                let _ = host(bias.grad(&grads).expect("dBias"));
                Run {
                    logp: logp_host,
                    lse: lse_host,
                    dhidden,
                    forward,
                    backward: start.elapsed(),
                }
            })
        })
        .collect();
    let runs: Vec<Run> = threads
        .into_iter()
        .map(|t| t.join().expect("rank thread"))
        .collect();
    let forward = runs.iter().map(|r| r.forward).max().unwrap_or_default();
    let backward = runs.iter().map(|r| r.backward).max().unwrap_or_default();
    let first = runs.into_iter().next().expect("world ≥ 1");
    Run {
        forward,
        backward,
        ..first
    }
}

fn run_single(data: &Data) -> Run {
    let hidden = tensor(data.hidden.clone(), [data.n, data.d]).require_grad();
    let weight = tensor(data.weight.clone(), [data.v, data.d]).require_grad();
    let bias = tensor(data.bias.clone(), [data.v]).require_grad();
    let options = LinearLogpOptions::default().with_ignore_index(PAD);
    let start = Instant::now();
    let (logp, lse) =
        linear_logp_with_lse(hidden.clone(), weight, targets(data), Some(bias), &options)
            .expect("linear_logp_with_lse");
    let (logp_host, lse_host) = (host(logp.clone().inner()), host(lse.clone().inner()));
    let forward = start.elapsed();
    let start = Instant::now();
    let grads = loss(logp, lse).backward();
    let dhidden = host(hidden.grad(&grads).expect("dHidden"));
    Run {
        logp: logp_host,
        lse: lse_host,
        dhidden,
        forward,
        backward: start.elapsed(),
    }
}

fn bitwise_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| {
            a.parse()
                .expect("arguments are numbers: [world] [tokens] [hidden] [vocab]")
        })
        .collect();
    let arg = |i: usize, default: usize| args.get(i).copied().unwrap_or(default);
    let (world, n, d, v) = (arg(0, 4), arg(1, 64), arg(2, 128), arg(3, 8192));
    println!("tp_linear_logp: world {world}, N = {n}, D = {d}, V = {v}, one CPU thread per rank");
    let data = Arc::new(data(n, d, v));

    let single = run_single(&data);
    println!(
        "single-rank linear_logp: forward {:>8.1?}  backward {:>8.1?}",
        single.forward, single.backward
    );
    let mut ok = true;
    // Within rounding of the single-rank API (a different summation order).
    let mut close_to_single = |run: &Run| {
        let (dl, dz, dh) = (
            max_abs_diff(&run.logp, &single.logp),
            max_abs_diff(&run.lse, &single.lse),
            max_abs_diff(&run.dhidden, &single.dhidden),
        );
        println!("  vs single-rank API, max |diff|: logp {dl:.2e}, lse {dz:.2e}, dHidden {dh:.2e}");
        ok &= dl <= 1e-4 && dz <= 1e-4 && dh <= 1e-4;
    };
    let base = run_tp(&data, 1);
    println!(
        "tp world 1             : forward {:>8.1?}  backward {:>8.1?}",
        base.forward, base.backward
    );
    close_to_single(&base);
    let mut worlds = vec![world];
    worlds.extend([2, 4, 8].into_iter().filter(|&w| w < world));
    worlds.sort_unstable();
    let mut bitwise = true;
    for w in worlds.into_iter().filter(|&w| w > 1) {
        let run = run_tp(&data, w);
        println!(
            "tp world {w}             : forward {:>8.1?}  backward {:>8.1?}",
            run.forward, run.backward
        );
        close_to_single(&run);
        if 8usize.is_multiple_of(w) {
            let same = bitwise_equal(&run.logp, &base.logp)
                && bitwise_equal(&run.lse, &base.lse)
                && bitwise_equal(&run.dhidden, &base.dhidden);
            println!("  bitwise equal to tp world 1 (logp, lse, dHidden): {same}");
            bitwise &= same;
        } else {
            println!("  world {w} does not divide 8: correct, but not bitwise comparable");
        }
    }
    ok &= bitwise;
    println!("{}", if ok { "OK" } else { "FAILED" });
    if !ok {
        std::process::exit(1);
    }
}
