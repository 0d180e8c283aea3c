//! The raw kernels of `kernels/` as cubecl tasks: one entry point per NVRTC compilation
//! (`IB_SELECT`, seconds instead of a minute for the whole unit), cached by cubecl under the
//! entry's name, launched on cubecl's own stream with cubecl's buffers so they order with
//! every other Burn op. The ABI (maps, buffers, parameter blocks, grids) is `kernels/README.md`.
use bytemuck::Pod;
use cubecl::cuda::{CudaCompiler, CudaComputeKernel, CudaRuntime};
use cubecl::prelude::*;
use cubecl::server::{Binding, KernelArguments, MetadataBindingInfo, TensorMapBinding};
use cubecl::{CompilationError, Compiler, CubeTask};
use cubecl_cpp::shared::{Body, Elem, Flags, Item, SharedMemory};

use super::table::{Entry, Unit};

const COMMON: &str = include_str!("../../../kernels/common.cuh");
const GEMM_UNIT: &str = include_str!("../../../kernels/gemm_sm90.cu");
const LOGP_UNIT: &str = include_str!("../../../kernels/linear_logp_sm90.cu");
const STREAM_SYNC_UNIT: &str = include_str!("../../../kernels/stream_sync.cu");
const ATTN_UNIT: &str = include_str!("../../../kernels/attention_sm90.cu");

/// The source NVRTC compiles for `entry` of `unit`.
fn source(unit: Unit, entry: &str) -> String {
    let selected =
        |unit: &str| format!("#define IB_SELECT\n#define IB_ENTRY_{entry}\n{COMMON}\n{unit}");
    match unit {
        Unit::Gemm => selected(GEMM_UNIT),
        Unit::Logp => selected(LOGP_UNIT),
        Unit::StreamSync => STREAM_SYNC_UNIT.to_string(),
        Unit::Attn => selected(ATTN_UNIT),
    }
}

/// An entry of the table (`kernels/entries.txt`) as a cubecl task.
#[derive(Debug, Clone, Copy)]
struct RawKernel(Entry);

impl KernelMetadata for RawKernel {
    fn id(&self) -> KernelId {
        // The sources are compile-time constants: the entry name identifies the binary.
        KernelId::new::<Self>()
            .info((self.0.name, self.0.smem))
            .cube_dim(CubeDim::new_1d(self.0.threads))
    }

    fn address_type(&self) -> StorageType {
        u32::as_type_native_unchecked().storage_type()
    }
}

/// cubecl-cuda reads only the dynamic shared-memory size from `repr`.
fn stub_repr(entry: &str, cube_dim: CubeDim, smem: usize) -> CudaComputeKernel {
    let shared_memories = match smem {
        0 => vec![],
        length => vec![SharedMemory::Array {
            index: 0,
            item: Item::scalar(Elem::U8, true),
            length,
            align: 16,
            offset: 0,
        }],
    };
    CudaComputeKernel {
        tensor_maps: vec![],
        buffers: vec![],
        scalars: vec![],
        info: Default::default(),
        meta_static_len: 0,
        body: Body {
            instructions: vec![],
            shared_memories,
            pipelines: vec![],
            barriers: vec![],
            const_arrays: vec![],
            local_arrays: vec![],
            info_by_ptr: false,
            has_dynamic_meta: false,
            address_type: Item::scalar(Elem::U32, true),
        },
        cube_dim,
        cluster_dim: None,
        extensions: vec![],
        flags: Flags::default(),
        items: Default::default(),
        kernel_name: entry.to_string(),
    }
}

impl CubeTask<CudaCompiler> for RawKernel {
    fn compile(
        &self,
        _compiler: &mut CudaCompiler,
        _options: &<CudaCompiler as Compiler>::CompilationOptions,
        _mode: ExecutionMode,
        _address_type: StorageType,
    ) -> Result<CompiledKernel<CudaCompiler>, CompilationError> {
        let Entry {
            name, unit, smem, ..
        } = self.0;
        let cube_dim = CubeDim::new_1d(self.0.threads);
        Ok(CompiledKernel {
            entrypoint_name: name.to_string(),
            debug_name: None,
            source: source(unit, name),
            repr: Some(stub_repr(name, cube_dim, smem)),
            cube_dim,
            debug_info: None,
        })
    }
}

/// Whether NVRTC compiles the kernels here: `libnvrtc` loads, the CUDA headers cubecl uses are
/// found, and `common.cuh` compiles for `sm_90a`. Checked once per process, synchronously, when
/// the registry first considers `Sm90`: a missing piece makes it unavailable with this reason
/// (the default then runs CubeCl; a forced `sm90` is an error) instead of failing at a launch,
/// whose error cubecl would only report at a later read.
pub(crate) fn toolchain() -> Result<(), String> {
    static CHECKED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    CHECKED
        .get_or_init(|| {
            // cudarc loads libnvrtc at the first call and panics where it is missing.
            std::panic::catch_unwind(compile_common).unwrap_or_else(|_| {
                Err("libnvrtc could not be loaded (is the CUDA toolkit's NVRTC installed?)".into())
            })
        })
        .clone()
}

/// `common.cuh` and an empty entry through NVRTC with cubecl's options for `sm_90a`.
fn compile_common() -> Result<(), String> {
    use cudarc::nvrtc::result as nvrtc;
    let Some(cuda) = cubecl::cuda::install::cuda_path() else {
        return Err("no CUDA installation found for NVRTC's headers (set CUDA_PATH)".into());
    };
    let include = cuda.join("include");
    let source =
        format!("#define IB_SELECT\n{COMMON}\nextern \"C\" __global__ void ib_probe() {{}}\n");
    let source = std::ffi::CString::new(source).map_err(|e| e.to_string())?;
    let options = [
        "--gpu-architecture=sm_90a".to_string(),
        format!("--include-path={}", include.display()),
    ];
    // SAFETY: NVRTC FFI on a program created here, destroyed before returning.
    unsafe {
        let program = nvrtc::create_program(source.as_c_str(), None)
            .map_err(|e| format!("nvrtcCreateProgram: {e:?}"))?;
        let compiled = nvrtc::compile_program(program, &options);
        let log = nvrtc::get_program_log(program)
            .map(|raw| {
                String::from_utf8_lossy(&raw.iter().map(|&c| c as u8).collect::<Vec<_>>())
                    .trim_end_matches('\0')
                    .trim()
                    .to_string()
            })
            .unwrap_or_default();
        let _ = nvrtc::destroy_program(program);
        compiled.map_err(|e| {
            format!(
                "NVRTC cannot compile the Sm90 kernels' header for sm_90a with the headers in {} \
                 ({e:?}): {log}",
                include.display()
            )
        })
    }
}

/// Launches `kernel` on `grid` blocks of its table's threads and dynamic shared memory
/// (`kernels/entries.txt`, looked up at compile time by the caller). Kernel parameters in cubecl's order: the maps, their
/// buffers, `buffers`, then `params` by value (a `params.rs` mirror of the kernel's struct).
pub(crate) fn launch<P: Pod>(
    client: &ComputeClient<CudaRuntime>,
    kernel: Entry,
    grid: usize,
    maps: Vec<TensorMapBinding>,
    buffers: Vec<Binding>,
    params: &P,
) {
    let info = super::params::words(params);
    let words = info.len();
    let args = KernelArguments::new()
        .with_tensor_maps(maps)
        .with_buffers(buffers)
        .with_info(MetadataBindingInfo::new(info, words));
    client.launch(
        Box::new(RawKernel(kernel)),
        CubeCount::Static(grid.max(1) as u32, 1, 1),
        args,
    );
}
