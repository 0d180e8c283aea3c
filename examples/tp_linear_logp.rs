//! Vocabulary-sharded (tensor-parallel) `linear_logp`: shard an LM head over `world` ranks,
//! run forward + backward, and check
//!  - TP-size invariance: logp, lse and dHidden bitwise equal to the world-1 TP run (when the
//!    world size divides 8, so the shards fall on segment boundaries);
//!  - agreement with the single-rank `linear_logp` within rounding;
//!
//! and print the forward+backward time of every world size (median of `iters` runs, each rank
//! synchronised with its device; the slowest rank counts).
//!
//! ```text
//! cargo run --release --example tp_linear_logp -- [world] [tokens] [hidden] [vocab] [iters]
//! cargo run --release --features cuda --example tp_linear_logp -- --cuda 4 4096 2048 131072 5
//! cargo run --release --features cuda --example tp_linear_logp -- --cuda-procs 4 4096 2048 131072 5
//! cargo run --release --features cuda --example tp_linear_logp -- --cuda 4 4096 2048 131072 5 --deferred
//! cargo run --release --example tp_linear_logp -- 4 --temperature 0.7 --entropy
//! ```
//! Defaults: world 4, N 64, D 128, V 8192, 1 iteration. CPU mode runs one thread per rank on
//! the NdArray reference with the in-process group. `--cuda` runs one thread per GPU (bf16,
//! `CubeBackend<CudaRuntime>`, the registry's choice of kernels) with one NCCL communicator
//! per GPU; it needs `world` visible GPUs. `--cuda-procs` runs the same world with one *process*
//! per GPU, the multi-process setup (`NcclId` made by the parent, passed to every rank in the
//! environment, `NcclGroup::new` per rank); rank 0 then also runs world 1 and checks the bits.
//! `RUST_LOG=burn_invariant::tp::trace=trace` prints the engine's phase timings (each phase then
//! waits for the device). `--deferred` builds the NCCL groups `with_deferred_failures(true)`: a
//! call returns without waiting on the host for its exchange. Besides each step timed alone,
//! `pipelined` is the time per step of `iters` steps enqueued back to back with one device sync
//! at the end.
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use burn::backend::Autodiff;
use burn::tensor::{DType, Int, Tensor, TensorData, backend::Backend};
use burn_invariant::tp::{self, Collective, InProcessGroup, VocabShard};
use burn_invariant::{InvariantBackend, LinearLogpOptions, LinearLogpOutput, linear_logp_full};

const PAD: i64 = -100;

struct Data {
    n: usize,
    d: usize,
    v: usize,
    hidden: Vec<f32>,
    weight: Vec<f32>,
    bias: Vec<f32>,
    targets: Vec<i64>,
    /// The head: ignore index, temperature, entropy.
    options: LinearLogpOptions,
}

/// logp, lse, entropy (empty when not asked for), dHidden (rank 0's; every rank has the same),
/// the median time, the median host
/// time (until the step returned, before the closing device sync), and the time per step of
/// steps enqueued back to back.
struct Run {
    logp: Vec<f32>,
    lse: Vec<f32>,
    entropy: Vec<f32>,
    dhidden: Vec<f32>,
    time: Duration,
    host: Duration,
    pipelined: Duration,
}

fn data(n: usize, d: usize, v: usize, head: Head) -> Data {
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
        options: head.options(),
    }
}

/// Where the ranks run: backend, devices, dtype and the collective group.
trait Platform: Send + Sync + 'static {
    type B: InvariantBackend;
    type G: Collective<Autodiff<Self::B>> + Clone + Send + 'static;
    fn name(&self) -> String;
    fn dtype(&self) -> DType;
    fn device(&self, rank: usize) -> burn::tensor::Device<Self::B>;
    fn groups(&self, world: usize) -> Vec<Self::G>;
}

struct Cpu;

impl Platform for Cpu {
    type B = burn::backend::NdArray<f32>;
    type G = InProcessGroup;
    fn name(&self) -> String {
        "one CPU thread per rank (NdArray reference, f32, in-process group)".into()
    }
    fn dtype(&self) -> DType {
        DType::F32
    }
    fn device(&self, _rank: usize) -> burn::tensor::Device<Self::B> {
        Default::default()
    }
    fn groups(&self, world: usize) -> Vec<Self::G> {
        InProcessGroup::new(world)
    }
}

#[cfg(feature = "cuda")]
struct Gpu {
    /// `NcclGroup::with_deferred_failures`.
    deferred: bool,
}

#[cfg(feature = "cuda")]
impl Platform for Gpu {
    type B = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
    type G = tp::NcclGroup;
    fn name(&self) -> String {
        format!(
            "one CUDA GPU per rank (bf16, NCCL group{})",
            if self.deferred {
                ", deferred failures"
            } else {
                ""
            }
        )
    }
    fn dtype(&self) -> DType {
        DType::BF16
    }
    fn device(&self, rank: usize) -> burn::tensor::Device<Self::B> {
        cubecl::cuda::CudaDevice::new(rank)
    }
    fn groups(&self, world: usize) -> Vec<Self::G> {
        let devices: Vec<_> = (0..world).map(|r| self.device(r)).collect();
        tp::NcclGroup::for_devices(&devices)
            .expect("NCCL group")
            .into_iter()
            .map(|g| g.with_deferred_failures(self.deferred))
            .collect()
    }
}

fn tensor<B: Backend, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &B::Device,
    dtype: DType,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(values, shape), (device, dtype))
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().to_vec().expect("f32 data")
}

fn targets<B: Backend>(data: &Data, device: &B::Device) -> Tensor<B, 1, Int> {
    Tensor::from_data(TensorData::new(data.targets.clone(), [data.n]), device)
}

/// Upstream gradients: `Σ logp + 0.1·Σ lse` (a z-loss-like term exercises dLse), and
/// `− 0.01·Σ entropy` when the head computes it (an entropy bonus exercises dEntropy).
fn loss<B: Backend>(out: &LinearLogpOutput<B>) -> Tensor<B, 1> {
    let loss = out.logp.clone().sum() + out.lse.clone().sum() * 0.1;
    match &out.entropy {
        Some(entropy) => loss - entropy.clone().sum() * 0.01,
        None => loss,
    }
}

/// The RL head of a run: temperature and whether the entropy is computed.
#[derive(Clone, Copy, Debug)]
struct Head {
    temperature: f64,
    entropy: bool,
}

impl Head {
    fn options(self) -> LinearLogpOptions {
        LinearLogpOptions::default()
            .with_ignore_index(PAD)
            .with_temperature(self.temperature)
            .with_entropy(self.entropy)
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort_unstable();
    times[times.len() / 2]
}

/// A step's outputs (without autodiff) and `dHidden`.
type Outputs<P> = (
    LinearLogpOutput<<P as Platform>::B>,
    Tensor<<P as Platform>::B, 2>,
);

/// One untimed warm-up (kernel compilation, NCCL connections), then `iters` timed calls of
/// `step` (forward + backward, returning the head's outputs and dHidden). Each call starts after a device
/// sync and `before` (the ranks' barrier) and ends with a device sync. Then `iters` calls
/// back to back, one device sync at the end: the pipelined time per step.
fn timed<P: Platform>(
    device: &burn::tensor::Device<P::B>,
    iters: usize,
    before: impl Fn(),
    mut step: impl FnMut() -> Outputs<P>,
) -> Run {
    let mut times = Vec::new();
    let mut host_times = Vec::new();
    let mut last = None;
    for _ in 0..=iters {
        <P::B as Backend>::sync(device).expect("device sync");
        before();
        let start = Instant::now();
        let outputs = step();
        host_times.push(start.elapsed());
        <P::B as Backend>::sync(device).expect("device sync");
        times.push(start.elapsed());
        last = Some(outputs);
    }
    before();
    let start = Instant::now();
    for _ in 0..iters {
        step();
    }
    <P::B as Backend>::sync(device).expect("device sync");
    let pipelined = start.elapsed() / iters as u32;
    let (out, dhidden) = last.expect("at least one run");
    Run {
        logp: host(out.logp),
        lse: host(out.lse),
        entropy: out.entropy.map(host).unwrap_or_default(),
        dhidden: host(dhidden),
        time: median(times[1..].to_vec()),
        host: median(host_times[1..].to_vec()),
        pipelined,
    }
}

/// Rank `rank` of a `world`-rank TP run: its shard of the LM head, timed forward + backward.
fn run_rank<P: Platform>(
    platform: &P,
    data: &Data,
    rank: usize,
    world: usize,
    group: &P::G,
    iters: usize,
    before: impl Fn(),
) -> Run {
    type AD<P> = Autodiff<<P as Platform>::B>;
    let (device, dtype) = (platform.device(rank), platform.dtype());
    let shard = VocabShard::split(rank, world, data.v);
    let rows = shard.range();
    let hidden = tensor::<AD<P>, 2>(data.hidden.clone(), [data.n, data.d], &device, dtype);
    let weight = tensor::<AD<P>, 2>(
        data.weight[rows.start * data.d..rows.end * data.d].to_vec(),
        [shard.len(), data.d],
        &device,
        dtype,
    );
    let bias = tensor::<AD<P>, 1>(data.bias[rows].to_vec(), [shard.len()], &device, dtype);
    let targets = targets::<AD<P>>(data, &device);
    timed::<P>(&device, iters, before, || {
        let hidden = hidden.clone().require_grad();
        let out = tp::linear_logp_full(
            hidden.clone(),
            weight.clone().require_grad(),
            targets.clone(),
            Some(bias.clone().require_grad()),
            &shard,
            group,
            &data.options,
        )
        .expect("tp::linear_logp_full");
        // dWeight/dBias of this shard are computed whether read or not.
        let grads = loss(&out).backward();
        let dhidden = hidden.grad(&grads).expect("dHidden");
        (inner(out), dhidden)
    })
}

/// A `world`-rank TP run with one thread per rank in this process.
fn run_tp<P: Platform>(platform: &Arc<P>, data: &Arc<Data>, world: usize, iters: usize) -> Run {
    let groups = platform.groups(world);
    let barrier = Arc::new(Barrier::new(world));
    let threads: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(rank, group)| {
            let (platform, data, barrier) = (platform.clone(), data.clone(), barrier.clone());
            std::thread::spawn(move || {
                run_rank(&*platform, &data, rank, world, &group, iters, || {
                    barrier.wait();
                })
            })
        })
        .collect();
    let runs: Vec<Run> = threads
        .into_iter()
        .map(|t| t.join().expect("rank thread"))
        .collect();
    let time = runs.iter().map(|r| r.time).max().unwrap_or_default();
    let host = runs.iter().map(|r| r.host).max().unwrap_or_default();
    let pipelined = runs.iter().map(|r| r.pipelined).max().unwrap_or_default();
    let first = runs.into_iter().next().expect("world ≥ 1");
    Run {
        time,
        host,
        pipelined,
        ..first
    }
}

fn run_single<P: Platform>(platform: &P, data: &Data, iters: usize) -> Run {
    type AD<P> = Autodiff<<P as Platform>::B>;
    let (device, dtype) = (platform.device(0), platform.dtype());
    let hidden = tensor::<AD<P>, 2>(data.hidden.clone(), [data.n, data.d], &device, dtype);
    let weight = tensor::<AD<P>, 2>(data.weight.clone(), [data.v, data.d], &device, dtype);
    let bias = tensor::<AD<P>, 1>(data.bias.clone(), [data.v], &device, dtype);
    let targets = targets::<AD<P>>(data, &device);
    timed::<P>(
        &device,
        iters,
        || {},
        || {
            let hidden = hidden.clone().require_grad();
            let out = linear_logp_full(
                hidden.clone(),
                weight.clone().require_grad(),
                targets.clone(),
                Some(bias.clone().require_grad()),
                &data.options,
            )
            .expect("linear_logp_full");
            let grads = loss(&out).backward();
            let dhidden = hidden.grad(&grads).expect("dHidden");
            (inner(out), dhidden)
        },
    )
}

/// The outputs without their autodiff graph.
fn inner<B: burn::tensor::backend::AutodiffBackend>(
    out: LinearLogpOutput<B>,
) -> LinearLogpOutput<B::InnerBackend> {
    LinearLogpOutput {
        logp: out.logp.inner(),
        lse: out.lse.inner(),
        entropy: out.entropy.map(Tensor::inner),
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

fn run<P: Platform>(platform: P, world: usize, sizes: [usize; 4], head: Head) -> bool {
    let [n, d, v, iters] = sizes;
    println!(
        "tp_linear_logp: world {world}, N = {n}, D = {d}, V = {v}, {}, {head:?}; \
         forward+backward, median of {iters}",
        platform.name()
    );
    let platform = Arc::new(platform);
    let data = Arc::new(data(n, d, v, head));
    let single = run_single(&*platform, &data, iters);
    println!(
        "single-rank linear_logp: {:>10.3?}  (host {:.3?}, pipelined {:.3?})",
        single.time, single.host, single.pipelined
    );
    // Within rounding of the single-rank API (a different summation order); bf16 inputs
    // round dHidden once per leaf.
    let tolerance = if platform.dtype() == DType::F32 {
        1e-4
    } else {
        2e-2
    };
    let mut ok = true;
    let mut close_to_single = |run: &Run| {
        let (dl, dz, de, dh) = (
            max_abs_diff(&run.logp, &single.logp),
            max_abs_diff(&run.lse, &single.lse),
            max_abs_diff(&run.entropy, &single.entropy),
            max_abs_diff(&run.dhidden, &single.dhidden),
        );
        println!(
            "  vs single-rank API, max |diff|: logp {dl:.2e}, lse {dz:.2e}, entropy {de:.2e}, \
             dHidden {dh:.2e}"
        );
        ok &= dl <= tolerance && dz <= tolerance && de <= tolerance && dh <= tolerance;
    };
    let base = run_tp(&platform, &data, 1, iters);
    println!(
        "tp world 1             : {:>10.3?}  (host {:.3?}, pipelined {:.3?})",
        base.time, base.host, base.pipelined
    );
    close_to_single(&base);
    let mut worlds = vec![world];
    worlds.extend([2, 4, 8].into_iter().filter(|&w| w < world));
    worlds.sort_unstable();
    let mut bitwise = true;
    for w in worlds.into_iter().filter(|&w| w > 1) {
        let run = run_tp(&platform, &data, w, iters);
        println!(
            "tp world {w}             : {:>10.3?}  ({:.3}× world 1, host {:.3?}, pipelined {:.3?})",
            run.time,
            run.time.as_secs_f64() / base.time.as_secs_f64(),
            run.host,
            run.pipelined
        );
        let ms = |t: Duration| t.as_secs_f64() * 1e3;
        println!(
            "RESULT tp_fwd_bwd world={w} n={n} d={d} v={v} t={} entropy={} ms={:.3} world1_ms={:.3} ratio={:.3} \
             pipelined_ms={:.3} world1_pipelined_ms={:.3} pipelined_ratio={:.3} single_ms={:.3} \
             single_pipelined_ms={:.3}",
            head.temperature,
            head.entropy,
            ms(run.time),
            ms(base.time),
            ms(run.time) / ms(base.time),
            ms(run.pipelined),
            ms(base.pipelined),
            ms(run.pipelined) / ms(base.pipelined),
            ms(single.time),
            ms(single.pipelined)
        );
        close_to_single(&run);
        if 8usize.is_multiple_of(w) {
            let same = bitwise_equal(&run.logp, &base.logp)
                && bitwise_equal(&run.lse, &base.lse)
                && bitwise_equal(&run.entropy, &base.entropy)
                && bitwise_equal(&run.dhidden, &base.dhidden);
            println!("  bitwise equal to tp world 1 (logp, lse, entropy, dHidden): {same}");
            bitwise &= same;
        } else {
            println!("  world {w} does not divide 8: correct, but not bitwise comparable");
        }
    }
    ok && bitwise
}

/// One process per GPU: the multi-process NCCL setup.
#[cfg(feature = "cuda")]
mod procs {
    use super::*;
    use burn_invariant::tp::{NcclGroup, NcclId};

    const ID_VAR: &str = "BURN_INVARIANT_EXAMPLE_NCCL_ID";

    /// Spawns `world` ranks of this binary (`--cuda-rank r ...`) and reports the slowest.
    pub fn parent(world: usize, sizes: [usize; 4], deferred: bool, head: Head) -> bool {
        let [n, d, v, iters] = sizes;
        println!(
            "tp_linear_logp: world {world}, N = {n}, D = {d}, V = {v}, one process per GPU \
             (bf16, NCCL group from an NcclId), {head:?}; forward+backward, median of {iters}"
        );
        let id = NcclId::new().expect("NCCL id");
        let exe = std::env::current_exe().expect("current executable");
        let children: Vec<_> = (0..world)
            .map(|rank| {
                std::process::Command::new(&exe)
                    .arg("--cuda-rank")
                    .args([rank, world, n, d, v, iters].map(|x| x.to_string()))
                    .args(deferred.then_some("--deferred"))
                    .args(["--temperature".to_string(), head.temperature.to_string()])
                    .args(head.entropy.then_some("--entropy"))
                    .env(ID_VAR, id.to_hex())
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .expect("spawning a rank")
            })
            .collect();
        let (mut slowest, mut slowest_pipelined) = (0f64, 0f64);
        let (mut base_ms, mut ok) = (None, true);
        for (rank, child) in children.into_iter().enumerate() {
            let output = child.wait_with_output().expect("rank process");
            ok &= output.status.success();
            for line in String::from_utf8_lossy(&output.stdout).lines() {
                println!("  rank {rank}: {line}");
                let value = |key: &str| {
                    line.split_whitespace()
                        .find_map(|w| w.strip_prefix(key))
                        .and_then(|x| x.parse::<f64>().ok())
                };
                if let Some(ms) = value("rank_ms=") {
                    slowest = slowest.max(ms);
                }
                if let Some(ms) = value("pipelined_ms=") {
                    slowest_pipelined = slowest_pipelined.max(ms);
                }
                if let Some(ms) = value("world1_ms=") {
                    base_ms = Some(ms);
                }
                ok &= !line.contains("bitwise=false");
            }
        }
        if let Some(base) = base_ms {
            println!(
                "RESULT tp_fwd_bwd_procs world={world} n={n} d={d} v={v} ms={slowest:.3} \
                 world1_ms={base:.3} ratio={:.3} pipelined_ms={slowest_pipelined:.3}",
                slowest / base
            );
        }
        ok && base_ms.is_some()
    }

    /// Rank `rank`: joins the group, runs the timed TP steps; rank 0 then runs world 1 in
    /// this process and compares the bits.
    pub fn child(rank: usize, world: usize, sizes: [usize; 4], deferred: bool, head: Head) -> bool {
        let [n, d, v, iters] = sizes;
        let id = std::env::var(ID_VAR).expect("the parent sets the NCCL id");
        let id = NcclId::from_hex(&id).expect("NCCL id");
        let gpu = Gpu { deferred };
        let device = gpu.device(rank);
        let group = NcclGroup::new(&device, rank, world, &id)
            .expect("joining the NCCL group")
            .with_deferred_failures(deferred);
        let data = Arc::new(data(n, d, v, head));
        // A host all-gather of one word is the cross-process barrier between iterations.
        let barrier = || {
            Collective::<Autodiff<<Gpu as Platform>::B>>::all_gather_host(&group, &[0])
                .expect("barrier");
        };
        let run = run_rank(&gpu, &data, rank, world, &group, iters, barrier);
        println!(
            "rank_ms={:.3} host_ms={:.3} pipelined_ms={:.3}",
            run.time.as_secs_f64() * 1e3,
            run.host.as_secs_f64() * 1e3,
            run.pipelined.as_secs_f64() * 1e3
        );
        drop(group);
        if rank != 0 {
            return true;
        }
        let base = run_tp(&Arc::new(gpu), &data, 1, iters);
        let same = bitwise_equal(&run.logp, &base.logp)
            && bitwise_equal(&run.lse, &base.lse)
            && bitwise_equal(&run.entropy, &base.entropy)
            && bitwise_equal(&run.dhidden, &base.dhidden);
        let comparable = 8usize.is_multiple_of(world);
        println!(
            "world1_ms={:.3} bitwise={}",
            base.time.as_secs_f64() * 1e3,
            if comparable {
                same.to_string()
            } else {
                "n/a".into()
            }
        );
        !comparable || same
    }
}

/// Vocabulary-sharded `linear_logp`: TP-size invariance and timing (see the file's header).
#[derive(clap::Parser)]
struct Args {
    /// One thread per GPU (feature `cuda`, bf16, NCCL).
    #[arg(long, conflicts_with = "cuda_procs")]
    cuda: bool,
    /// One process per GPU (feature `cuda`).
    #[arg(long)]
    cuda_procs: bool,
    /// Internal: this process is rank `R` of a `--cuda-procs` run.
    #[arg(long, hide = true, value_name = "R")]
    cuda_rank: Option<usize>,
    /// Build the NCCL groups `with_deferred_failures(true)`.
    #[arg(long)]
    deferred: bool,
    /// The head's temperature.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Compute (and differentiate) the per-row entropy too.
    #[arg(long)]
    entropy: bool,
    /// Ranks.
    #[arg(default_value_t = 4)]
    world: usize,
    /// Rows N.
    #[arg(default_value_t = 64)]
    tokens: usize,
    /// Hidden size D.
    #[arg(default_value_t = 128)]
    hidden: usize,
    /// Vocabulary V.
    #[arg(default_value_t = 8192)]
    vocab: usize,
    /// Timed steps.
    #[arg(default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
}

fn main() {
    env_logger::init();
    let args = <Args as clap::Parser>::parse();
    let (world, n, d, v, iters) = (
        args.world,
        args.tokens,
        args.hidden,
        args.vocab,
        args.iters as usize,
    );
    let head = Head {
        temperature: args.temperature,
        entropy: args.entropy,
    };
    let sizes = [n, d, v, iters];
    #[cfg(feature = "cuda")]
    {
        let done = match (args.cuda_procs, args.cuda_rank) {
            (_, Some(rank)) => Some(procs::child(rank, world, sizes, args.deferred, head)),
            (true, None) => Some(procs::parent(world, sizes, args.deferred, head)),
            (false, None) => None,
        };
        if let Some(ok) = done {
            println!("{}", if ok { "OK" } else { "FAILED" });
            std::process::exit(if ok { 0 } else { 1 });
        }
    }
    let ok = if args.cuda || args.cuda_procs || args.cuda_rank.is_some() {
        #[cfg(feature = "cuda")]
        {
            run(
                Gpu {
                    deferred: args.deferred,
                },
                world,
                sizes,
                head,
            )
        }
        #[cfg(not(feature = "cuda"))]
        {
            eprintln!("--cuda needs the `cuda` feature: cargo run --features cuda --example ...");
            std::process::exit(2);
        }
    } else {
        run(Cpu, world, sizes, head)
    };
    println!("{}", if ok { "OK" } else { "FAILED" });
    if !ok {
        std::process::exit(1);
    }
}
