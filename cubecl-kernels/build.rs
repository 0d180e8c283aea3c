//! `BURN_INVARIANT_CUBECL_SOURCE_HASH`: FNV-1a 64 of every file under `src/` (path and bytes,
//! in path order), for the crate's `SOURCE_HASH`: two builds launch the same kernels exactly
//! when their sources hash the same. FNV because its value is fixed by its definition, whatever
//! the compiler version (std's hashers are not).
use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read src/")
        .map(|e| e.expect("a directory entry").path())
        .collect();
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
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for path in &paths {
        let name = path
            .strip_prefix(root)
            .expect("under the crate")
            .to_string_lossy();
        let bytes = std::fs::read(path).expect("read a source file");
        for &b in name.as_bytes().iter().chain(&[0]).chain(&bytes) {
            hash = (hash ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    println!("cargo:rustc-env=BURN_INVARIANT_CUBECL_SOURCE_HASH={hash:016x}");
    println!("cargo:rerun-if-changed=src");
}
