//! Shared test helpers: runtime selection, deterministic data, upload/download, CPU references.
#![allow(dead_code)]

use cubecl::ir::{ElemType, FloatKind, IntKind, StorageType};
use cubecl::prelude::*;
use cubecl::zspace::{Shape, Strides};
use half::f16;

/// Run `f` on the wgpu runtime if an adapter exists. Without one, print a notice and return,
/// unless `BURN_INVARIANT_REQUIRE_WGPU=1`, in which case fail.
pub fn with_wgpu(test: &str, f: impl FnOnce(&ComputeClient<cubecl::wgpu::WgpuRuntime>)) {
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
    let require = std::env::var("BURN_INVARIANT_REQUIRE_WGPU").is_ok_and(|v| v == "1");
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let client = std::panic::catch_unwind(|| WgpuRuntime::client(&WgpuDevice::default()));
    std::panic::set_hook(prev);
    match client {
        Ok(c) => f(&c),
        Err(_) => {
            if require {
                panic!("{test}: no wgpu adapter found and BURN_INVARIANT_REQUIRE_WGPU=1");
            }
            eprintln!("NOTICE {test}: no wgpu adapter found; test skipped");
        }
    }
}

/// Run `f` on CUDA device 0 (only with the crate's `cuda` feature).
#[cfg(feature = "cuda")]
/// Runs `f` on CUDA device 0; without a CUDA driver and GPU it prints a notice and returns,
/// unless `BURN_INVARIANT_REQUIRE_CUDA=1`, in which case it fails.
pub fn with_cuda(f: impl FnOnce(&ComputeClient<cubecl::cuda::CudaRuntime>)) {
    use cubecl::cuda::{CudaDevice, CudaRuntime};
    // cudarc loads libcuda lazily and panics when it is absent.
    let has_gpu = std::panic::catch_unwind(|| {
        cudarc::driver::result::init().is_ok()
            && cudarc::driver::result::device::get_count().is_ok_and(|n| n > 0)
    })
    .unwrap_or(false);
    if !has_gpu {
        let require = std::env::var("BURN_INVARIANT_REQUIRE_CUDA").is_ok_and(|v| v == "1");
        assert!(
            !require,
            "no CUDA device, and BURN_INVARIANT_REQUIRE_CUDA=1 requires one"
        );
        eprintln!(
            "NOTICE: no CUDA device found, skipping (set BURN_INVARIANT_REQUIRE_CUDA=1 to fail instead)"
        );
        return;
    }
    let client = CudaRuntime::client(&CudaDevice::new(0));
    f(&client)
}

pub fn runtime_name<R: Runtime>(client: &ComputeClient<R>) -> &'static str {
    R::name(client)
}

pub fn is_cuda<R: Runtime>(client: &ComputeClient<R>) -> bool {
    R::name(client).contains("cuda")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dt {
    F32,
    F16,
    BF16,
}

impl Dt {
    pub fn storage(self) -> StorageType {
        StorageType::Scalar(ElemType::Float(match self {
            Dt::F32 => FloatKind::F32,
            Dt::F16 => FloatKind::F16,
            Dt::BF16 => FloatKind::BF16,
        }))
    }
    pub fn size(self) -> usize {
        match self {
            Dt::F32 => 4,
            _ => 2,
        }
    }
    /// Round an f32 to this dtype and back.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Dt::F32 => x,
            Dt::F16 => f16::from_f32(x).to_f32(),
            Dt::BF16 => half::bf16::from_f32(x).to_f32(),
        }
    }
    pub fn encode(self, xs: &[f32]) -> Vec<u8> {
        match self {
            Dt::F32 => xs.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Dt::F16 => xs
                .iter()
                .flat_map(|x| f16::from_f32(*x).to_le_bytes())
                .collect(),
            Dt::BF16 => xs
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect(),
        }
    }
    pub fn decode(self, b: &[u8]) -> Vec<f32> {
        match self {
            Dt::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dt::F16 => b
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dt::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    }
}

pub fn i32_storage() -> StorageType {
    StorageType::Scalar(ElemType::Int(IntKind::I32))
}

pub fn i64_storage() -> StorageType {
    StorageType::Scalar(ElemType::Int(IntKind::I64))
}

/// Deterministic pseudo-random values in [-1, 1), already rounded to `dt`.
pub fn rand_vec(seed: u64, n: usize, dt: Dt) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = ((s >> 40) as f32) / ((1u64 << 24) as f32);
            dt.round(2.0 * u - 1.0)
        })
        .collect()
}

/// A device buffer plus the view to pass to the kernels.
pub struct Buf<R: Runtime> {
    pub handle: cubecl::server::Handle,
    pub binding: TensorBinding<R>,
    pub dt_size: usize,
}

impl<R: Runtime> Buf<R> {
    pub fn b(&self) -> &TensorBinding<R> {
        &self.binding
    }
}

pub fn view<R: Runtime>(
    handle: &cubecl::server::Handle,
    shape: &[usize],
    strides: &[usize],
) -> TensorBinding<R> {
    unsafe {
        TensorBinding::from_raw_parts(
            handle.clone(),
            Strides::new(strides),
            Shape::from(shape.to_vec()),
        )
    }
}

pub fn dense_strides(shape: &[usize]) -> Vec<usize> {
    let mut st = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        st[d] = st[d + 1] * shape[d + 1];
    }
    st
}

/// Upload `data` (row-major logical values) as a dense tensor of `shape` in dtype `dt`.
pub fn upload<R: Runtime>(
    client: &ComputeClient<R>,
    data: &[f32],
    shape: &[usize],
    dt: Dt,
) -> Buf<R> {
    let bytes = dt.encode(data);
    let bytes = if bytes.is_empty() {
        vec![0u8; 16]
    } else {
        bytes
    };
    let handle = client.create_from_slice(&bytes);
    let binding = view(&handle, shape, &dense_strides(shape));
    Buf {
        handle,
        binding,
        dt_size: dt.size(),
    }
}

/// Upload the transpose storage of a row-major [r, c] matrix and return a strided view of the
/// original logical [r, c] matrix (strides (1, r)).
pub fn upload_transposed_view<R: Runtime>(
    client: &ComputeClient<R>,
    data: &[f32],
    r: usize,
    c: usize,
    dt: Dt,
) -> Buf<R> {
    let mut t = vec![0.0f32; r * c];
    for i in 0..r {
        for j in 0..c {
            t[j * r + i] = data[i * c + j];
        }
    }
    let bytes = dt.encode(&t);
    let handle = client.create_from_slice(&bytes);
    let binding = view(&handle, &[r, c], &[1, r]);
    Buf {
        handle,
        binding,
        dt_size: dt.size(),
    }
}

/// Upload a row-major [r, c] matrix with rows `row_stride >= c` elements apart; the gaps hold NaN,
/// which a kernel reading out of bounds would spread.
pub fn upload_row_padded<R: Runtime>(
    client: &ComputeClient<R>,
    data: &[f32],
    r: usize,
    c: usize,
    row_stride: usize,
    dt: Dt,
) -> Buf<R> {
    let mut t = vec![f32::NAN; (r - 1) * row_stride + c];
    for i in 0..r {
        t[i * row_stride..i * row_stride + c].copy_from_slice(&data[i * c..(i + 1) * c]);
    }
    let handle = client.create_from_slice(&dt.encode(&t));
    let binding = view(&handle, &[r, c], &[row_stride, 1]);
    Buf {
        handle,
        binding,
        dt_size: dt.size(),
    }
}

pub fn upload_i32<R: Runtime>(client: &ComputeClient<R>, data: &[i32]) -> Buf<R> {
    let mut bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
    if bytes.is_empty() {
        bytes = vec![0u8; 16];
    }
    let handle = client.create_from_slice(&bytes);
    let binding = view(&handle, &[data.len()], &[1]);
    Buf {
        handle,
        binding,
        dt_size: 4,
    }
}

pub fn upload_i64<R: Runtime>(client: &ComputeClient<R>, data: &[i64]) -> Buf<R> {
    let mut bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
    if bytes.is_empty() {
        bytes = vec![0u8; 16];
    }
    let handle = client.create_from_slice(&bytes);
    let binding = view(&handle, &[data.len()], &[1]);
    Buf {
        handle,
        binding,
        dt_size: 8,
    }
}

/// Allocate an output of `shape` (optionally with a padded row stride) filled with a sentinel.
pub fn alloc<R: Runtime>(
    client: &ComputeClient<R>,
    shape: &[usize],
    strides: &[usize],
    dt: Dt,
) -> Buf<R> {
    let mut len = 1usize;
    for d in 0..shape.len() {
        if shape[d] == 0 {
            len = 0;
            break;
        }
        len += (shape[d] - 1) * strides[d];
    }
    let fill = vec![-7.25f32; len.max(4)];
    let handle = client.create_from_slice(&dt.encode(&fill));
    let binding = view(&handle, shape, strides);
    Buf {
        handle,
        binding,
        dt_size: dt.size(),
    }
}

pub fn alloc_dense<R: Runtime>(client: &ComputeClient<R>, shape: &[usize], dt: Dt) -> Buf<R> {
    alloc(client, shape, &dense_strides(shape), dt)
}

/// Read a whole buffer as dtype `dt`.
pub fn read_raw<R: Runtime>(client: &ComputeClient<R>, buf: &Buf<R>, dt: Dt) -> Vec<f32> {
    let bytes = client.read_one(buf.handle.clone()).expect("read back");
    dt.decode(&bytes)
}

/// Read the logical [r, c] (or [r] with c = 1) contents of a strided view.
pub fn read_2d<R: Runtime>(
    client: &ComputeClient<R>,
    buf: &Buf<R>,
    dt: Dt,
    r: usize,
    c: usize,
) -> Vec<f32> {
    let raw = read_raw(client, buf, dt);
    let st = &buf.binding.strides;
    let (s0, s1) = if st.len() == 2 {
        (st[0], st[1])
    } else {
        (st[0], 0)
    };
    let mut out = Vec::with_capacity(r * c);
    for i in 0..r {
        for j in 0..c {
            out.push(raw[i * s0 + j * s1]);
        }
    }
    out
}

pub fn bits(xs: &[f32]) -> Vec<u32> {
    xs.iter().map(|x| x.to_bits()).collect()
}

/// f64 reference GEMM on already-rounded inputs. Returns (value, Σ|a·b|).
pub fn gemm_f64(
    a: &[f32],
    b: &[f32],
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f64;
            let mut ab = 0.0f64;
            for p in 0..k {
                let t = a[i * k + p] as f64 * b[p * n + j] as f64;
                acc += t;
                ab += t.abs();
            }
            if let Some(bias) = bias {
                acc += bias[j] as f64;
                ab += (bias[j] as f64).abs();
            }
            out[i * n + j] = acc;
            mag[i * n + j] = ab;
        }
    }
    (out, mag)
}

/// The CPU `f32::mul_add` chain reference (exactly the FMA-path contract).
pub fn gemm_mul_add_chain(
    a: &[f32],
    b: &[f32],
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
) -> Vec<f32> {
    let mut out = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f32;
            for p in 0..k {
                acc = a[i * k + p].mul_add(b[p * n + j], acc);
            }
            if let Some(bias) = bias {
                acc += bias[j];
            }
            out[i * n + j] = acc;
        }
    }
    out
}

/// Check `got` against the f64 reference with a bound relative to Σ|a·b| and the output dtype.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], mag: &[f64], dt: Dt, k: usize) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let out_eps = match dt {
        Dt::F32 => f32::EPSILON as f64,
        Dt::F16 => 1.0 / 1024.0,
        Dt::BF16 => 1.0 / 128.0,
    };
    let acc_eps = f32::EPSILON as f64 * (k as f64 + 2.0);
    let mut worst = 0.0f64;
    for i in 0..got.len() {
        let err = (got[i] as f64 - want[i]).abs();
        let tol = acc_eps * mag[i] + out_eps * want[i].abs() + 1e-30;
        assert!(
            err <= tol * 1.01 + 1e-12,
            "{what}: element {i}: got {} want {} (err {err:e}, tol {tol:e})",
            got[i],
            want[i]
        );
        worst = worst.max(err / (mag[i] + 1e-30));
    }
    let _ = worst;
}
