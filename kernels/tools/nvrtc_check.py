#!/usr/bin/env python3
"""Compile every sm_90a entry point (source = common.cuh ++ <kernel>.cu) with NVRTC to a cubin.

Same options the Rust side (cubecl-cuda) uses: --gpu-architecture=sm_90a -lineinfo --include-path=<CUDA include>.
Works without a GPU: `pip install "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*"`.
Entry points: every `entry` line of kernels/entries.txt (read_table() below; the harness uses it too).
Default: each entry point compiled alone, as the Rust side does ("#define IB_SELECT" + "#define IB_ENTRY_<name>"
prepended), and checked to be exported. --full: each whole file instead (all entry points in one cubin; --out DIR
writes those cubins for sm90_harness.py --cubin-dir). Exit status 0 only if everything compiles and exports.
--cubecl DIR: instead, every CubeCL kernel source that cubecl-kernels/tests/codegen.rs wrote (DIR/sm_80/*.cu and
DIR/sm_90/*.cu, one per kernel variant the crate launches), compiled as cubecl-cuda compiles them at run time
(--gpu-architecture=sm_80, or sm_90a for 9.0; -lineinfo; the CUDA and CCCL headers); HIP folders must be non-empty,
and where `hipcc` is on PATH their sources compile for their gfx target (device code, as hiprtc), except what that
ROCm cannot build, which is said (hip_sources). Every variant goes through the front end, and each entry point's
largest variant to a binary (SYNTAX_ONLY).
Usage: nvrtc_check.py [--full] [--out DIR] [--ptxas-v] [--verbose] | --cubecl DIR
"""
import concurrent.futures
import hashlib
import collections
import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
KDIR = os.path.dirname(HERE)


def read_table(path=os.path.join(KDIR, "entries.txt")):
    """kernels/entries.txt (the one table the Rust side reads too): ({name: Entry} in table order,
    {NAME: value} of its define and host lines)."""
    entries, constants = {}, {}
    with open(path) as f:
        for line in f:
            fields = line.split("#")[0].split()
            if not fields:
                continue
            if fields[0] == "entry" and len(fields) == 8:
                name, file, threads, smem, cluster, tile, stages = fields[1:]
                rows, cols = (int(x) for x in tile.split("x")) if tile != "-" else (0, 0)
                entries[name] = Entry(name, file, int(threads), int(smem), int(cluster), rows, cols,
                                      0 if stages == "-" else int(stages))
            elif fields[0] in ("define", "host") and len(fields) in (3, 4):
                constants[fields[1]] = int(fields[2])
            else:
                raise ValueError(f"{path}: cannot read line {line!r}")
    return entries, constants


Entry = collections.namedtuple("Entry", "name file threads smem cluster rows cols stages")
ENTRIES, CONSTANTS = read_table()
SOURCES = {}  # file -> its entry points, in table order
for _e in ENTRIES.values():
    SOURCES.setdefault(_e.file, []).append(_e.name)

# Compiled alone (no common.cuh, no entry selection), every entry at once, as the Rust side does.
STANDALONE = {"stream_sync.cu"}


def _candidates_lib():
    out = []
    try:
        import nvidia  # wheel namespace package
        for base in list(nvidia.__path__):
            out += sorted(glob.glob(os.path.join(base, "cu13", "lib", "libnvrtc.so*")))
            out += sorted(glob.glob(os.path.join(base, "cuda_nvrtc", "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    for root in (os.environ.get("CUDA_PATH", ""), os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if root:
            out += sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")))
    return [p for p in out if "builtins" not in p and ".alt." not in p]


def _include_dirs():
    dirs = []
    try:
        import nvidia
        for base in list(nvidia.__path__):
            for sub in ("cu13/include", "cu13/include/cccl", "cuda_runtime/include", "cuda_nvrtc/include",
                        "cuda_crt/include", "cuda_cccl/include"):
                d = os.path.join(base, sub)
                if os.path.isdir(d):
                    dirs.append(d)
    except ImportError:
        pass
    for root in (os.environ.get("CUDA_PATH", ""), os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        d = os.path.join(root, "include") if root else ""
        if d and os.path.isfile(os.path.join(d, "cuda_bf16.h")):
            dirs.append(d)
    # keep the first directory that holds the headers we need
    good = [d for d in dirs if os.path.isfile(os.path.join(d, "cuda_bf16.h"))]
    return good[:1] + [d for d in dirs if d not in good[:1]]


_lib = None


def load_nvrtc():
    global _lib
    if _lib is not None:
        return _lib
    errs = []
    for p in _candidates_lib():
        try:
            # libnvrtc dlopens its builtins by soname; preload the one beside it so no LD_LIBRARY_PATH is needed
            for b in sorted(glob.glob(os.path.join(os.path.dirname(p), "libnvrtc-builtins.so*"))):
                if ".alt." not in b:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            _lib = ctypes.CDLL(p)
            return _lib
        except OSError as e:
            errs.append(f"{p}: {e}")
    raise RuntimeError("libnvrtc not found: " + "; ".join(errs))


def kernel_source(cu_name, entry=None):
    with open(os.path.join(KDIR, cu_name)) as f:
        body = f.read()
    if cu_name in STANDALONE:
        return body
    with open(os.path.join(KDIR, "common.cuh")) as f:
        common = f.read()
    sel = f"#define IB_SELECT\n#define IB_ENTRY_{entry}\n" if entry else ""
    return sel + common + "\n" + body  # exactly what the Rust side concatenates


def compile_cubin(src, name="kernel.cu", extra=(), arch="sm_90a"):
    """Returns (cubin bytes, log). Raises RuntimeError with the log on failure."""
    lib = load_nvrtc()
    prog = ctypes.c_void_p()
    r = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None)
    if r != 0:
        raise RuntimeError(f"nvrtcCreateProgram failed: {r}")
    inc = _include_dirs()
    opts = [f"--gpu-architecture={arch}", "-lineinfo"] + [f"--include-path={d}" for d in inc] + list(extra)
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    r = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, buf)
    log = buf.value.decode(errors="replace")
    if r != 0:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        raise RuntimeError(f"NVRTC compile of {name} failed ({r}), options {opts}:\n{log}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw, log


def hipcc(arch, path, syntax_only=False):
    """Compiles one HIP source for `arch` (device code only, as hiprtc does at run time), or with
    `syntax_only` runs its front end alone."""
    with tempfile.TemporaryDirectory() as tmp:
        out = ["-fsyntax-only"] if syntax_only else ["-c", "-o", os.path.join(tmp, "k.o")]
        r = subprocess.run(["hipcc", f"--offload-arch={arch}", "--cuda-device-only", path] + out,
                           capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip()[:4000])


def hip_probe(arch, source):
    """Whether this hipcc compiles `source` for `arch`: (True, "") or (False, its first error line)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.hip")
        with open(path, "w") as f:
            f.write(source)
        try:
            hipcc(arch, path)
            return True, ""
        except RuntimeError as e:
            return False, next((l for l in str(e).splitlines() if "error" in l), str(e)[:200])


def hip_sources(arch, files):
    """The jobs of one HIP folder, for the hipcc on PATH (Debian 12: ROCm 5.2). Said, not failed: no
    hipcc, an architecture it cannot target, and sources that include a header it lacks
    (hip/hip_bf16.h came with a later ROCm). Every other source must compile."""
    if shutil.which("hipcc") is None:
        print(f"OK   {arch}: {len(files)} HIP sources generated (no hipcc here)", flush=True)
        return []
    kernel = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = 1.0f; }\n'
    ok, why = hip_probe(arch, "#include <hip/hip_runtime.h>\n" + kernel)
    if not ok:
        print(f"SKIP {arch}: {len(files)} HIP sources not compiled: this hipcc cannot target it ({why})", flush=True)
        return []
    missing = [h for h in ("hip/hip_bf16.h",) if not hip_probe(arch, f"#include <{h}>\n" + kernel)[0]]
    jobs, skipped = [], 0
    for path in files:
        with open(path) as f:
            src = f.read()
        if any(f"#include <{h}>" in src for h in missing):
            skipped += 1
        else:
            jobs.append((arch, path, src))
    if skipped:
        print(f"SKIP {arch}: {skipped} HIP sources include {', '.join(missing)}, which this ROCm lacks", flush=True)
    return jobs


# Every variant goes through the front end (types and overloads resolved, and on NVRTC the architecture's
# intrinsics: where a kernel breaks when a source change meets NVRTC or hipcc), and the largest variant of each
# entry point through code generation too (NVVM and ptxas, or LLVM's AMDGPU back end, where hipcc checks target
# builtins): an entry point's variants differ in comptime values, not in the instructions they may use, and code
# generation is most of a compile's time.
SYNTAX_ONLY = ("-fdevice-syntax-only",)
# HIP sources per front-end pass: hipcc spends about a second on the HIP headers, a tenth of that on a kernel.
HIP_UNIT = 48
ENTRY_NAME = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(')


def largest_per_entry(sources):
    """The paths of the largest source per entry point name (the file name less its order prefix)."""
    largest = {}
    for path, src in sources:
        entry = os.path.basename(path).split("-", 1)[-1]
        if entry not in largest or len(src) > len(largest[entry][1]):
            largest[entry] = (path, src)
    return set(path for path, _ in largest.values())


def one_unit(paths):
    """Generated sources as one translation unit, so the headers are read once: each source in its own
    namespace, its entry point renamed (C linkage ignores namespaces)."""
    includes, bodies = [], []
    for i, path in enumerate(paths):
        with open(path) as f:
            lines = f.read().splitlines()
        includes += [l for l in lines if l.startswith("#include") and l not in includes]
        body = "\n".join(l for l in lines if not l.startswith("#include"))
        entries = ENTRY_NAME.findall(body)
        if len(entries) != 1:
            raise RuntimeError(f"{path}: {len(entries)} entry points, expected one")
        bodies.append(f"#define {entries[0]} unit{i}_{entries[0]}\nnamespace unit{i} {{\n{body}\n}}\n"
                      f"#undef {entries[0]}\n")
    return "\n".join(includes) + "\n" + "".join(bodies)


def hip_front_end(arch, paths):
    """hipcc's front end over `paths` in one unit; where the unit fails (or cannot be formed), each source alone,
    to name the ones at fault. A unit that fails while every source passes alone is a failure of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        unit = os.path.join(tmp, "unit.hip")
        try:
            with open(unit, "w") as f:
                f.write(one_unit(paths))
            hipcc(arch, unit, syntax_only=True)
            return []
        except RuntimeError as unit_error:
            failures = []
            for path in paths:
                try:
                    hipcc(arch, path, syntax_only=True)
                except RuntimeError as e:
                    failures.append((path, e))
            return failures or [(paths[0], f"the unit of {len(paths)} sources from this one fails, each alone "
                                            f"passes:\n{unit_error}")]


def pool():
    """Worker processes, one per core: NVRTC compiles one program at a time per process."""
    return concurrent.futures.ProcessPoolExecutor(max_workers=len(os.sched_getaffinity(0)))


def cubecl_job(job):
    """One job of check_cubecl: a source to a binary, or sources through the front end. Returns failures."""
    kind, arch, paths, root = job
    try:
        if arch.startswith("gfx"):
            if kind == "full":
                hipcc(arch, paths[0])
                return []
            return [f"FAIL {arch} {os.path.relpath(p, root)}: {e}" for p, e in hip_front_end(arch, paths)]
        with open(paths[0]) as f:
            compile_cubin(f.read(), os.path.basename(paths[0]), () if kind == "full" else SYNTAX_ONLY, arch=arch)
        return []
    except (RuntimeError, OSError) as e:
        return [f"FAIL {arch} {os.path.relpath(paths[0], root)}: {e}"]


def check_cubecl(root):
    """Every CUDA source under root/sm_*/ through NVRTC for its folder's architecture (each distinct source
    once), every HIP folder non-empty and its sources through hipcc where one is installed (hip_sources):
    all through the front end, each entry point's largest variant to a binary. Returns True when all pass."""
    ok, jobs = True, []
    for arch_dir in sorted(glob.glob(os.path.join(root, "*"))):
        arch = os.path.basename(arch_dir)
        files = sorted(glob.glob(os.path.join(arch_dir, "*.cu")) + glob.glob(os.path.join(arch_dir, "*.hip")))
        if not files:
            print(f"FAIL {arch}: no kernel sources in {arch_dir}", flush=True)
            ok = False
            continue
        cuda = arch.startswith("sm_")
        if cuda:
            nv_arch = arch + ("a" if int(arch[3:]) >= 90 else "")
            sources = []
            for path in files:
                with open(path) as f:
                    sources.append((path, f.read()))
        else:
            nv_arch = arch
            sources = [(path, src) for _, path, src in hip_sources(arch, files)]
            if not sources:
                continue
        seen = {}
        for path, src in sources:
            seen.setdefault(hashlib.sha256(src.encode()).hexdigest(), (path, src))
        full = largest_per_entry(seen.values())
        jobs += [("full", nv_arch, [path], root) for path in sorted(full)]
        # One source per NVRTC job; a HIP unit holds sources with the same includes, so none compiles with a
        # header it lacks.
        units = collections.defaultdict(list)
        for path, src in seen.values():
            if path not in full:
                units[path if cuda else tuple(l for l in src.splitlines() if l.startswith("#include"))].append(path)
        size = 1 if cuda else HIP_UNIT
        jobs += [("front", nv_arch, unit[i:i + size], root)
                 for unit in units.values() for i in range(0, len(unit), size)]
        print(f"     {arch}: {len(files)} kernels, {len(seen)} distinct sources compiled, {len(full)} of them "
              f"(each entry point's largest) to binaries, the others through the front end", flush=True)

    t = time.time()
    with pool() as workers:
        failures = [f for r in workers.map(cubecl_job, jobs) for f in r]
    for failure in failures:
        # The source is in the file; the log's first lines say why.
        print(failure[:4000], flush=True)
    sources = sum(len(job[2]) for job in jobs)
    print(f"{'OK  ' if not failures else 'FAIL'} {sources - len(failures)}/{sources} CubeCL CUDA/HIP sources compile "
          f"({time.time() - t:.0f}s)", flush=True)
    return ok and not failures


def sm90_job(job):
    """One entry point (or file) of kernels/ to a cubin: (cubin, log, seconds), or the error."""
    cu, sel, _, extra = job
    t = time.time()
    try:
        return compile_cubin(kernel_source(cu, sel), cu, extra) + (time.time() - t,)
    except (RuntimeError, OSError) as e:
        return e


def main():
    if "--cubecl" in sys.argv:
        sys.exit(0 if check_cubecl(sys.argv[sys.argv.index("--cubecl") + 1]) else 1)
    verbose = "--verbose" in sys.argv
    full = "--full" in sys.argv or "--out" in sys.argv
    extra = ["--ptxas-options=-v"] if "--ptxas-v" in sys.argv else []
    out_dir = None
    if "--out" in sys.argv:
        out_dir = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out_dir, exist_ok=True)
    jobs = [(cu, sel, expect) for cu, entries in SOURCES.items()
            for sel, expect in ([(None, entries)] if full or cu in STANDALONE else [(e, [e]) for e in entries])]

    ok = True
    with pool() as workers:
        results = workers.map(sm90_job, [job + (extra,) for job in jobs])  # printed in table order
        for (cu, sel, expect), result in zip(jobs, results):
            label = cu if sel is None else f"{cu}:{sel}"
            if isinstance(result, Exception):
                print(f"FAIL {label}: {result}", flush=True)
                ok = False
                continue
            cubin, log, seconds = result
            entries = SOURCES[cu]
            missing = [e for e in expect if e.encode() + b"\0" not in cubin]
            others = [e for e in entries if e not in expect and e.encode() + b"\0" in cubin]
            if missing:
                print(f"FAIL {label}: entry points missing from cubin: {missing}", flush=True)
                ok = False
            else:
                print(f"OK   {label}: {len(cubin)} bytes cubin, {len(expect)} entry point(s), {seconds:.1f}s"
                      + (f" (also has {len(others)} unselected)" if others else ""), flush=True)
            if "C7508" in log or "warning" in log.lower():
                print(log)
            elif verbose and log:
                print(log)
            if out_dir and sel is None:
                with open(os.path.join(out_dir, cu.replace(".cu", ".cubin")), "wb") as f:
                    f.write(cubin)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
