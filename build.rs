//! `BURN_INVARIANT_SOURCE_HASH`: FNV-1a 64 (`src/fnv.rs`) of every file under `src/` and of the
//! CUDA sources and launch table in `kernels/` (path and bytes, in path order) for
//! `fingerprint`: two builds run the same code exactly when their sources hash the same. The
//! CubeCL kernel crate, published on its own, hashes its sources in its own `build.rs`
//! (`burn_invariant_cubecl::SOURCE_HASH`).
use std::path::{Path, PathBuf};

#[path = "src/fnv.rs"]
mod fnv;

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(read) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = read.map(|e| e.expect("a directory entry").path()).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            files(&path, out);
        } else {
            out.push(path);
        }
    }
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut paths = Vec::new();
    files(&root.join("src"), &mut paths);
    // The CUDA sources and their launch table, not the tools beside them.
    let mut kernels: Vec<PathBuf> = std::fs::read_dir(root.join("kernels"))
        .into_iter()
        .flatten()
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| {
            p.is_file()
                && matches!(
                    p.extension().and_then(|e| e.to_str()),
                    Some("cu" | "cuh" | "txt")
                )
        })
        .collect();
    kernels.sort();
    paths.extend(kernels);
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=kernels");
    let hash = paths.iter().fold(fnv::EMPTY, |hash, path| {
        let name = path.strip_prefix(root).expect("under the crate");
        let bytes = std::fs::read(path).expect("read a source file");
        let hash = fnv::fnv1a(hash, name.to_string_lossy().bytes().chain([0]));
        fnv::fnv1a(hash, bytes)
    });
    println!("cargo:rustc-env=BURN_INVARIANT_SOURCE_HASH={hash:016x}");
}
