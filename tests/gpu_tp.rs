//! Tensor-parallel `linear_logp` on CUDA GPUs with the NCCL group: one thread per GPU, bf16
//! and f32. World sizes 1, 2, 4 (and 3 for uneven shards) run as far as GPUs are visible.
//! Without a CUDA driver every test prints a notice and passes, unless
//! `BURN_INVARIANT_REQUIRE_CUDA=1` makes that a failure (the GPU runs set it).
#![cfg(feature = "cuda")]

#[allow(unused_macros)] // the generic suite macro is not used here
mod common;

use std::panic::catch_unwind;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::DType;
use burn_invariant::tp::{self, InProcessGroup, NcclGroup, NcclId, VocabShard};
use burn_invariant::{InvariantError, LinearLogpOptions};
use common::ranks::{self, bits_of};
use common::tp_problem::{Problem, RankOut, problem, rank_run, single_rank};
use common::{assert_bits_eq, float, ints, matrix_rows};
use cubecl::cuda::CudaDevice;
use serial_test::serial;

type B = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
type AD = burn::backend::Autodiff<B>;
type FusedAD = burn::backend::Autodiff<
    burn_fusion::Fusion<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>>,
>;

const WATCHDOG: Duration = Duration::from_secs(300);

/// Visible GPUs; 0 (with a notice) when there is no driver and none is required.
fn gpus() -> usize {
    let count = catch_unwind(|| {
        cudarc::driver::result::init().ok()?;
        cudarc::driver::result::device::get_count().ok()
    })
    .ok()
    .flatten()
    .unwrap_or(0) as usize;
    if count == 0 {
        if std::env::var("BURN_INVARIANT_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
            panic!("cuda: no device, and BURN_INVARIANT_REQUIRE_CUDA=1 requires one");
        }
        eprintln!("NOTICE: cuda: no device found, skipping");
    }
    count
}

/// Whether `needed` GPUs are visible; a notice when they are not.
fn have_gpus(needed: usize) -> bool {
    let gpus = gpus();
    if gpus < needed {
        eprintln!("NOTICE: needs {needed} GPUs, {gpus} visible: skipped");
    }
    gpus >= needed
}

/// Runs `f(rank)` on one thread per rank; results in rank order, bounded by the watchdog.
fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize) -> T + Send + Sync + 'static,
) -> Vec<T> {
    ranks::on_ranks(vec![(); world], WATCHDOG, move |rank, ()| f(rank))
}

/// TP over `shards` (one GPU each), NCCL groups joined through one id (the multi-process path,
/// here with threads).
fn run_nccl(p: &Problem, shards: &[VocabShard]) -> Vec<RankOut> {
    run_nccl_with(p, shards, false)
}

/// [`run_nccl`] with the groups' `with_deferred_failures(deferred)`.
fn run_nccl_with(p: &Problem, shards: &[VocabShard], deferred: bool) -> Vec<RankOut> {
    let (p, shards) = (Arc::new(p.clone()), shards.to_vec());
    let world = shards.len();
    let id = NcclId::from_hex(&NcclId::new().expect("NCCL id").to_hex()).expect("id round trip");
    on_ranks(world, move |rank| {
        let device = CudaDevice::new(rank);
        let group = NcclGroup::new(&device, rank, world, &id)
            .expect("NCCL group")
            .with_deferred_failures(deferred);
        rank_run::<AD, _>(&p, &device, shards[rank], &group)
    })
}

fn split(world: usize, v: usize) -> Vec<VocabShard> {
    (0..world).map(|r| VocabShard::split(r, world, v)).collect()
}

fn assert_same(what: &str, got: &RankOut, expected: &RankOut) {
    assert_bits_eq(
        &format!("{what}: logp"),
        &bits_of(&got.logp),
        &bits_of(&expected.logp),
    );
    assert_bits_eq(
        &format!("{what}: lse"),
        &bits_of(&got.lse),
        &bits_of(&expected.lse),
    );
    assert_eq!(got.entropy.is_some(), expected.entropy.is_some(), "{what}");
    assert_bits_eq(
        &format!("{what}: entropy"),
        &bits_of(got.entropy.as_deref().unwrap_or_default()),
        &bits_of(expected.entropy.as_deref().unwrap_or_default()),
    );
    assert_bits_eq(
        &format!("{what}: dHidden"),
        &bits_of(&got.hidden),
        &bits_of(&expected.hidden),
    );
}

fn assert_close(what: &str, got: &[f32], expected: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert!(
            (g - e).abs() <= atol + rtol * e.abs(),
            "{what}[{i}]: got {g}, expected {e} (atol {atol}, rtol {rtol})"
        );
    }
}

/// `tp::linear_sample` on NCCL, bf16: the tokens, logp, lse and entropy are bitwise the same on
/// every rank and for world sizes 1, 2 and 4 (as far as GPUs are visible), for plain sampling,
/// greedy, top-5 and top-64.
#[test]
#[serial]
fn nccl_tp_sample_is_bitwise_invariant_across_world_sizes() {
    let gpus = gpus();
    if gpus == 0 {
        return;
    }
    let p = Arc::new(problem([37, 136, 50021], DType::BF16, true, None, 15));
    let base = burn_invariant::SampleOptions::default()
        .with_seed(99)
        .with_temperature(0.8)
        .with_entropy(true);
    for options in [
        base.clone(),
        base.clone().with_greedy(true),
        base.clone().with_top_k(5),
        base.clone().with_top_k(64),
    ] {
        let draw = |world: usize| {
            let (p, options) = (p.clone(), options.clone());
            let id = NcclId::new().expect("NCCL id");
            on_ranks(world, move |rank| {
                let device = CudaDevice::new(rank);
                let group = NcclGroup::new(&device, rank, world, &id).expect("NCCL group");
                let shard = VocabShard::split(rank, world, p.v);
                let out = tp::linear_sample(
                    float::<B, 2>(p.hidden.clone(), [p.n, p.d], &device, p.dtype),
                    matrix_rows::<B>(&p.weight, p.d, shard.range(), &device, p.dtype),
                    ints::<B>((0..p.n as i64).map(|i| 5 * i + 1).collect(), &device),
                    p.bias.as_ref().map(|b| {
                        float::<B, 1>(b[shard.range()].to_vec(), [shard.len()], &device, p.dtype)
                    }),
                    &shard,
                    &group,
                    &options,
                )
                .expect("tp::linear_sample");
                let host = |t: burn::tensor::Tensor<B, 1>| -> Vec<f32> {
                    t.into_data().convert::<f32>().iter::<f32>().collect()
                };
                let tokens: Vec<i64> = out.tokens.into_data().iter::<i64>().collect();
                let entropy = out.entropy.map(host).unwrap_or_default();
                (tokens, host(out.logp), host(out.lse), entropy)
            })
        };
        let one = draw(1);
        assert!(
            one[0].0.iter().all(|&t| (0..p.v as i64).contains(&t)),
            "{options:?}: tokens in range"
        );
        for world in [2, 4].into_iter().filter(|&w| w <= gpus) {
            for (rank, out) in draw(world).iter().enumerate() {
                let what = format!("{options:?} world {world} rank {rank}");
                assert_eq!(out.0, one[0].0, "{what}: tokens");
                let want = &one[0];
                for (name, got, want) in [
                    ("logp", &out.1, &want.1),
                    ("lse", &out.2, &want.2),
                    ("entropy", &out.3, &want.3),
                ] {
                    assert_bits_eq(&format!("{what}: {name}"), &bits_of(got), &bits_of(want));
                }
            }
        }
    }
}

/// logp, lse, entropy, dHidden (and the concatenated dWeight/dBias) are bitwise the same for
/// world sizes 1, 2 and 4, on every rank, with ragged shards (V a multiple of neither); the RL
/// head at temperatures 0.7 and 1.3 with entropy, the last with groups that defer failures.
#[test]
#[serial]
fn nccl_tp_is_bitwise_invariant_across_world_sizes() {
    let gpus = gpus();
    if gpus == 0 {
        return;
    }
    for (shape, dtype, with_bias, seed, temperature, deferred) in [
        ([37, 136, 50021], DType::BF16, true, 11, None, false),
        ([29, 72, 4100], DType::F32, false, 12, None, false),
        ([37, 136, 50021], DType::BF16, true, 13, Some(0.7), false),
        ([37, 136, 50021], DType::BF16, true, 14, Some(1.3), true),
    ] {
        let mut p = problem(shape, dtype, with_bias, Some(5), seed);
        if let Some(t) = temperature {
            p.options = p.options.with_temperature(t).with_entropy(true);
        }
        let reference = run_nccl(&p, &split(1, p.v));
        for world in [2, 4].into_iter().filter(|&w| w <= gpus) {
            let outs = run_nccl_with(&p, &split(world, p.v), deferred);
            for (rank, out) in outs.iter().enumerate() {
                assert_same(
                    &format!("{dtype:?} V={} world {world} rank {rank} vs world 1", p.v),
                    out,
                    &reference[0],
                );
            }
            let weight: Vec<f32> = outs.iter().flat_map(|o| o.weight.clone()).collect();
            assert_bits_eq(
                &format!("{dtype:?} world {world}: dWeight vs world 1"),
                &bits_of(&weight),
                &bits_of(&reference[0].weight),
            );
            if let Some(expected) = &reference[0].bias {
                let bias: Vec<f32> = outs.iter().flat_map(|o| o.bias.clone().unwrap()).collect();
                assert_bits_eq(
                    &format!("{dtype:?} world {world}: dBias vs world 1"),
                    &bits_of(&bias),
                    &bits_of(expected),
                );
            }
            eprintln!(
                "nccl tp {dtype:?} V={} world {world}: bitwise = world 1",
                p.v
            );
        }
    }
}

/// NCCL moves the same bits as the in-process group, so both give identical results; and
/// `NcclGroup::for_devices` (ncclCommInitAll) works like the id path.
#[test]
#[serial]
fn nccl_group_equals_in_process_group_on_cuda() {
    let gpus = gpus();
    if gpus == 0 {
        return;
    }
    let world = gpus.min(2);
    let p = Arc::new(problem([23, 64, 3001], DType::BF16, true, Some(5), 21));
    let shards = split(world, p.v);
    let devices: Vec<_> = (0..world).map(CudaDevice::new).collect();
    let nccl_groups = NcclGroup::for_devices(&devices).expect("ncclCommInitAll");
    let (pn, sn) = (p.clone(), shards.clone());
    let nccl = on_ranks(world, move |rank| {
        rank_run::<AD, _>(&pn, &CudaDevice::new(rank), sn[rank], &nccl_groups[rank])
    });
    let host_groups = InProcessGroup::new(world);
    let (ph, sh) = (p.clone(), shards.clone());
    let in_process = on_ranks(world, move |rank| {
        rank_run::<AD, _>(&ph, &CudaDevice::new(rank), sh[rank], &host_groups[rank])
    });
    for rank in 0..world {
        assert_same(
            &format!("rank {rank}: NCCL vs in-process"),
            &nccl[rank],
            &in_process[rank],
        );
    }
}

/// The fused CUDA backend exchanges through the same group (Fusion ↔ cubecl buffers).
#[test]
#[serial]
fn nccl_tp_runs_under_fusion() {
    let gpus = gpus();
    if gpus == 0 {
        return;
    }
    let world = gpus.min(2);
    let p = Arc::new(problem([19, 40, 2111], DType::F32, true, Some(5), 31));
    let shards = split(world, p.v);
    let devices: Vec<_> = (0..world).map(CudaDevice::new).collect();
    let groups = NcclGroup::for_devices(&devices).expect("ncclCommInitAll");
    let (pf, sf, gf) = (p.clone(), shards.clone(), groups.clone());
    let fused = on_ranks(world, move |rank| {
        rank_run::<FusedAD, _>(&pf, &CudaDevice::new(rank), sf[rank], &gf[rank])
    });
    let raw = on_ranks(world, move |rank| {
        rank_run::<AD, _>(&p, &CudaDevice::new(rank), shards[rank], &groups[rank])
    });
    for rank in 0..world {
        for (what, got, expected) in [
            ("logp", &fused[rank].logp, &raw[rank].logp),
            ("lse", &fused[rank].lse, &raw[rank].lse),
            ("dHidden", &fused[rank].hidden, &raw[rank].hidden),
        ] {
            assert_close(
                &format!("fusion rank {rank} {what}"),
                got,
                expected,
                1e-5,
                1e-5,
            );
        }
    }
}

/// Against the single-rank API on one GPU, within bf16 rounding; uneven shards (world 3 when
/// three GPUs exist, else a cut segment with two).
#[test]
#[serial]
fn nccl_tp_matches_the_single_rank_api() {
    let gpus = gpus();
    if gpus == 0 {
        return;
    }
    let p = problem([41, 96, 7001], DType::BF16, true, Some(5), 41);
    let single = single_rank::<AD>(&p, &CudaDevice::new(0));
    let mut layouts = vec![split(gpus.min(2), p.v)];
    if gpus >= 3 {
        layouts.push(split(3, p.v));
    } else if gpus == 2 {
        layouts.push(vec![
            VocabShard::new(0, 1234, p.v),
            VocabShard::new(1234, p.v, p.v),
        ]);
    }
    for shards in layouts {
        let outs = run_nccl(&p, &shards);
        for (rank, out) in outs.iter().enumerate() {
            let what = format!("world {} rank {rank}", shards.len());
            assert_close(&format!("{what} logp"), &out.logp, &single.logp, 2e-3, 2e-3);
            assert_close(&format!("{what} lse"), &out.lse, &single.lse, 2e-3, 2e-3);
            assert_close(
                &format!("{what} dHidden"),
                &out.hidden,
                &single.hidden,
                2e-2,
                2e-2,
            );
        }
    }
}

/// World 1: after a call, `settle` has nothing left to wait for, and the group reports its
/// GPU (the validation compares each rank's tensors with it).
#[test]
#[serial]
fn a_settled_group_reports_its_device() {
    use burn_invariant::tp::Collective;
    if !have_gpus(1) {
        return;
    }
    let device = CudaDevice::new(0);
    let groups = NcclGroup::for_devices(std::slice::from_ref(&device)).expect("ncclCommInitAll");
    let p = problem([8, 16, 512], DType::F32, false, None, 71);
    let out = rank_run::<AD, _>(&p, &device, VocabShard::split(0, 1, p.v), &groups[0]);
    assert!(out.logp.iter().all(|v| v.is_finite()), "{:?}", out.logp);
    Collective::<AD>::settle(&groups[0]).expect("nothing in flight");
    assert_eq!(Collective::<AD>::device(&groups[0]), Some(device));
}

/// A validation failure on one rank is the same typed error on every rank, and the groups stay
/// usable (validation happens before any compute): a local error on rank 1 (its weight does not
/// match its shard), then targets that differ between ranks.
#[test]
#[serial]
fn a_failure_on_one_rank_fails_every_rank_the_same_way() {
    if !have_gpus(2) {
        return;
    }
    let world = 2;
    let p = Arc::new(problem([16, 32, 1000], DType::BF16, false, Some(5), 51));
    let devices: Vec<_> = (0..world).map(CudaDevice::new).collect();
    let groups = NcclGroup::for_devices(&devices).expect("ncclCommInitAll");
    let errors = on_ranks(world, move |rank| {
        let device = CudaDevice::new(rank);
        let shard = VocabShard::split(rank, world, p.v);
        let call_with = |rows: usize, targets: Vec<i64>, options: &LinearLogpOptions| {
            tp::linear_logp(
                float::<B, 2>(p.hidden.clone(), [p.n, p.d], &device, p.dtype),
                matrix_rows::<B>(
                    &p.weight,
                    p.d,
                    shard.start..shard.start + rows,
                    &device,
                    p.dtype,
                ),
                ints::<B>(targets, &device),
                None,
                &shard,
                &groups[rank],
                options,
            )
        };
        let call = |rows: usize, targets: Vec<i64>| call_with(rows, targets, &p.options);
        let rows = if rank == 1 {
            shard.len() - 1
        } else {
            shard.len()
        };
        let local = call(rows, p.targets.clone()).expect_err("a short weight must fail");
        let mut targets = p.targets.clone();
        if rank == 1 {
            targets[3] = (targets[3] + 1) % p.v as i64;
        }
        let mismatch = call(shard.len(), targets).expect_err("differing targets must fail");
        // A target out of range on rank 1 only.
        let mut targets = p.targets.clone();
        if rank == 1 {
            targets[5] = p.v as i64;
        }
        let out_of_range = call(shard.len(), targets).expect_err("an out-of-range target");
        // A bad temperature on rank 1 only.
        let options = if rank == 1 {
            p.options.clone().with_temperature(0.0)
        } else {
            p.options.clone()
        };
        let temperature = call_with(shard.len(), p.targets.clone(), &options)
            .expect_err("a bad temperature on one rank");
        // The group still works after validation failures.
        let again = call(shard.len(), p.targets.clone());
        assert!(again.is_ok(), "rank {rank}: group unusable: {again:?}");
        (local, mismatch, out_of_range, temperature)
    });
    assert_eq!(errors[0], errors[1], "every rank reports the same errors");
    assert!(
        matches!(errors[0].0, InvariantError::RankFailed { rank: 1, .. }),
        "got {:?}",
        errors[0].0
    );
    assert!(
        matches!(errors[0].1, InvariantError::RankMismatch { rank: 1, .. }),
        "got {:?}",
        errors[0].1
    );
    for error in [&errors[0].2, &errors[0].3] {
        assert!(
            matches!(
                error,
                InvariantError::RankFailed { rank: 1, .. }
                    | InvariantError::RankMismatch { rank: 1, .. }
            ),
            "got {error:?}"
        );
    }
}

/// A rank that never calls the collective makes the other fail within the timeout, not hang;
/// a rank that never joins makes `NcclGroup::new` fail in bounded time.
#[test]
#[serial]
fn a_missing_rank_fails_in_bounded_time() {
    if !have_gpus(2) {
        return;
    }
    let timeout = Duration::from_secs(3);
    let id = NcclId::new().unwrap();
    let start = Instant::now();
    let lonely = NcclGroup::with_timeout(&CudaDevice::new(0), 0, 2, &id, timeout);
    assert!(
        matches!(lonely, Err(InvariantError::Collective { .. })),
        "got {lonely:?}"
    );
    assert!(
        start.elapsed() < timeout * 4,
        "join took {:?}",
        start.elapsed()
    );

    let id = NcclId::new().unwrap();
    let p = Arc::new(problem([8, 16, 512], DType::F32, false, Some(5), 61));
    let results = on_ranks(2, move |rank| {
        let device = CudaDevice::new(rank);
        let group = NcclGroup::with_timeout(&device, rank, 2, &id, timeout).expect("join");
        if rank == 1 {
            return None; // never calls tp::linear_logp
        }
        let shard = VocabShard::split(rank, 2, p.v);
        let start = Instant::now();
        let result = tp::linear_logp(
            float::<B, 2>(p.hidden.clone(), [p.n, p.d], &device, p.dtype),
            matrix_rows::<B>(&p.weight, p.d, shard.range(), &device, p.dtype),
            ints::<B>(p.targets.clone(), &device),
            None,
            &shard,
            &group,
            &p.options,
        );
        Some((result.err(), start.elapsed()))
    });
    let (error, elapsed) = results[0].clone().unwrap();
    assert!(
        matches!(error, Some(InvariantError::Collective { .. })),
        "got {error:?}"
    );
    assert!(elapsed < timeout * 4, "waited {elapsed:?}");
}

/// A tensor exchange only enqueues (it is ordered on the device, not through the host), so a
/// missing peer cannot make it return an error: its result turns NaN once the device-side wait
/// times out, and the next call on the group fails. The group is dropped right after a
/// completed exchange on the other path: dropping waits for in-flight exchanges.
#[test]
#[serial]
fn a_tensor_exchange_without_its_peer_gives_nan_then_an_error() {
    use burn_invariant::tp::Collective;
    if !have_gpus(2) {
        return;
    }
    let timeout = Duration::from_secs(3);
    let (values, waited, settled, next) =
        without_a_peer(timeout, false, |group, gathered, start| {
            let values: Vec<f32> = gathered.into_data().to_vec().unwrap();
            let waited = start.elapsed();
            // What a `tp` call runs before it returns: the exchange's failure, on this call.
            let settled = Collective::<B>::settle(group).err();
            let next = Collective::<B>::all_gather_host(group, &[1]);
            (values, waited, settled, next.err())
        });
    assert!(
        matches!(settled, Some(InvariantError::Collective { .. })),
        "settle: got {settled:?}"
    );
    assert_eq!(values.len(), 6);
    assert!(values.iter().all(|v| v.is_nan()), "got {values:?}");
    assert!(
        waited >= timeout && waited < timeout * 4,
        "waited {waited:?}"
    );
    assert!(
        matches!(next, Some(InvariantError::Collective { .. })),
        "got {next:?}"
    );

    // Both ranks exchange, then drop their groups at once: the result is complete and exact.
    // Host blocks longer than one envelope round-trip too; blocks of different lengths fail
    // on every rank.
    let (id, fresh) = (NcclId::new().unwrap(), NcclId::new().unwrap());
    let results = on_ranks(2, move |rank| {
        let device = CudaDevice::new(rank);
        let group = NcclGroup::with_timeout(&device, rank, 2, &id, timeout).expect("join");
        let long: Vec<u64> = (0..300).map(|i| rank as u64 * 1000 + i).collect();
        let host = Collective::<B>::all_gather_host(&group, &long).expect("host gather");
        let mismatched = Collective::<B>::all_gather_host(&group, &long[..5 + rank]).err();
        let gathered = {
            let group = NcclGroup::with_timeout(&device, rank, 2, &fresh, timeout)
                .expect("join a fresh group");
            let block = float::<B, 1>(vec![rank as f32 + 0.5; 4], [4], &device, DType::F32);
            Collective::<B>::all_gather(&group, block).expect("enqueued")
        };
        (
            host,
            mismatched,
            gathered.into_data().to_vec::<f32>().unwrap(),
        )
    });
    let expected: Vec<u64> = (0..2u64)
        .flat_map(|r| (0..300).map(move |i| r * 1000 + i))
        .collect();
    for (host, mismatched, values) in results {
        assert_eq!(host, expected);
        assert!(
            matches!(mismatched, Some(InvariantError::Collective { .. })),
            "got {mismatched:?}"
        );
        assert_eq!(values, [0.5, 0.5, 0.5, 0.5, 1.5, 1.5, 1.5, 1.5]);
    }
}

/// With deferred failures a call's end does not wait on the host for its exchange: the missing
/// peer's exchange still comes back NaN once the device-side wait times out, and `settle` and
/// the group's next call report it.
#[test]
#[serial]
fn deferred_failures_are_reported_by_settle_and_the_next_call() {
    use burn_invariant::tp::Collective;
    if !have_gpus(2) {
        return;
    }
    let timeout = Duration::from_secs(3);
    let (ended, returned, values, settled, next) =
        without_a_peer(timeout, true, |group, gathered, start| {
            let ended = Collective::<B>::end_call(group);
            let returned = start.elapsed();
            let values: Vec<f32> = gathered.into_data().to_vec().unwrap();
            let settled = Collective::<B>::settle(group).err();
            let next = Collective::<B>::all_gather_host(group, &[1]);
            (ended.is_ok(), returned, values, settled, next.err())
        });
    assert!(ended, "end_call waits for nothing with deferred failures");
    assert!(returned < timeout, "returned after {returned:?}");
    assert!(values.iter().all(|v| v.is_nan()), "got {values:?}");
    assert!(
        matches!(settled, Some(InvariantError::Collective { .. })),
        "settle: got {settled:?}"
    );
    assert!(
        matches!(next, Some(InvariantError::Collective { .. })),
        "got {next:?}"
    );
}

/// Two ranks join a group (`with_deferred_failures(deferred)`); rank 1 never exchanges, rank 0
/// enqueues an all-gather of three floats and runs `then(group, gathered, start)` (`start`: just
/// before the all-gather). Returns rank 0's result.
fn without_a_peer<T: Clone + Send + 'static>(
    timeout: Duration,
    deferred: bool,
    then: impl Fn(&NcclGroup, burn::tensor::Tensor<B, 1>, Instant) -> T + Send + Sync + 'static,
) -> T {
    use burn_invariant::tp::Collective;
    let id = NcclId::new().unwrap();
    let results = on_ranks(2, move |rank| {
        let device = CudaDevice::new(rank);
        let group = NcclGroup::with_timeout(&device, rank, 2, &id, timeout)
            .expect("join")
            .with_deferred_failures(deferred);
        if rank == 1 {
            return None; // never exchanges
        }
        let block = float::<B, 1>(vec![1.0, 2.0, 3.0], [3], &device, DType::F32);
        let start = Instant::now();
        let gathered = Collective::<B>::all_gather(&group, block).expect("enqueued");
        Some(then(&group, gathered, start))
    });
    results[0].clone().expect("rank 0 exchanged")
}
