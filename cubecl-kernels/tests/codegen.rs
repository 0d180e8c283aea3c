//! Every kernel this crate launches, at every comptime variant (`sweep`), expanded and turned
//! into CUDA C++ for sm_80 and sm_90 and HIP C++ for gfx90a and gfx1100 by CubeCL's own code
//! generator, without a GPU (`record`). An expansion panic or a generator error fails here; the
//! sources are written to `target/kernel-sources/<arch>/` (or `$BURN_INVARIANT_KERNEL_SOURCES`)
//! for `kernels/tools/nvrtc_check.py --cubecl`, which compiles the CUDA ones with NVRTC as
//! cubecl-cuda does at run time. WGSL gets the same check from the wgpu suites.
mod common;
mod record;
mod sweep;

use std::collections::BTreeMap;
use std::path::PathBuf;

use cubecl::prelude::*;
use record::{Recorded, Target};

fn sources_dir() -> PathBuf {
    std::env::var_os("BURN_INVARIANT_KERNEL_SOURCES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/kernel-sources")
        })
}

/// Entry points the CUDA profiles must reach, so that a profile or sweep change that loses the
/// tensor-core paths or bf16 fails here rather than checking less.
const CUDA_MUST_REACH: [&str; 4] = [
    "gemm_cmma_kernel",
    "attention_tc_forward_kernel",
    "logp_dz_from_logits_kernel",
    "_bf16",
];

/// Launches the sweep on `client` and returns what its target's generator wrote.
fn generate<R: Runtime>(client: &ComputeClient<R>, target: Target) -> Vec<Recorded> {
    let launches = sweep::launch_every_variant(client);
    cubecl::future::block_on(client.sync()).expect("the recording server never fails");
    let recorded = record::take(target);
    assert!(
        launches > 0 && !recorded.is_empty(),
        "{target:?}: nothing was launched"
    );
    recorded
}

/// Writes the sources of `target` (one file per distinct kernel, named by its order) and an
/// index naming each file's kernel with its comptime parameters; returns the failures.
fn write(target: Target, recorded: &[Recorded], ext: &str) -> Vec<String> {
    let dir = sources_dir().join(target.name());
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the sources folder");
    let mut index = String::new();
    let mut failures = Vec::new();
    for (i, kernel) in recorded.iter().enumerate() {
        match &kernel.source {
            Ok(source) => {
                let file = format!("{i:03}-{}.{ext}", kernel.entrypoint);
                std::fs::write(dir.join(&file), source).expect("write a source");
                index += &format!("{file}\t{}\n", kernel.name);
            }
            Err(why) => failures.push(format!("{} {}: {why}", target.name(), kernel.name)),
        }
    }
    std::fs::write(dir.join("index.tsv"), index).expect("write the index");
    failures
}

#[test]
fn every_kernel_generates_cuda_and_hip_sources() {
    let mut failures = Vec::new();
    let mut counts = BTreeMap::new();
    for target in Target::CUDA {
        let recorded = generate(&record::cuda_client(target), target);
        counts.insert(target.name(), recorded.len());
        for part in CUDA_MUST_REACH {
            assert!(
                recorded.iter().any(|k| k.entrypoint.contains(part)),
                "{}: no kernel `*{part}*` was launched",
                target.name()
            );
        }
        failures.extend(write(target, &recorded, "cu"));
    }
    for target in Target::HIP {
        let recorded = generate(&record::hip_client(target), target);
        counts.insert(target.name(), recorded.len());
        failures.extend(write(target, &recorded, "hip"));
    }
    println!(
        "distinct kernels per target: {counts:?}, in {}",
        sources_dir().display()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
