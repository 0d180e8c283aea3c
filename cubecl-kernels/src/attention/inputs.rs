//! The inputs' checks, the size limits and the launch parameters.

use super::tile::{
    AttnCfg, AttnInputsLaunch, AttnParamsLaunch, DKV_PAD, GradInputsLaunch, S_PAD, STAGE_LEN,
    Strides4Launch, THREADS, UNITS,
};
use super::{ATTENTION_MAX_HEAD_DIM, AttentionDims, AttentionGradRefs, AttentionRefs};
use crate::error::KernelError;
use crate::gemm::fma::{FmaMode, fma_mode};
use crate::util::{
    FloatDType, View, check_runtime_dtype, check_view, expect_shape, raw_arg, to_u32,
};
use cubecl::prelude::*;

impl AttentionDims {
    /// Query heads per KV head (0 without KV heads).
    pub fn group(&self) -> usize {
        self.heads.checked_div(self.kv_heads).unwrap_or(0)
    }
}

/// The validated inputs.
pub(crate) struct Checked {
    pub dt: FloatDType,
    pub dims: AttentionDims,
    pub q: View,
    pub k: View,
    pub v: View,
    pub lens: View,
    pub causal: bool,
    pub scale: f32,
}

pub(crate) fn check_inputs<R: Runtime>(
    client: &ComputeClient<R>,
    inp: &AttentionRefs<'_, R>,
) -> Result<Checked, KernelError> {
    let dt = inp.dtype;
    check_runtime_dtype(client, "dtype", dt.storage())?;
    let es = dt.size();
    let q = check_view("query", inp.query, 4, es)?;
    let k = check_view("key", inp.key, 4, es)?;
    let v = check_view("value", inp.value, 4, es)?;
    let lens = check_view("kv_lens", inp.kv_lens, 1, 4)?;
    let dims = AttentionDims {
        batch: q.dim(0),
        heads: q.dim(1),
        kv_heads: k.dim(1),
        q_len: q.dim(2),
        kv_len: k.dim(2),
        head_dim: q.dim(3),
    };
    let kv_shape = [dims.batch, dims.kv_heads, dims.kv_len, dims.head_dim];
    if k.dim(0) != dims.batch || k.dim(3) != dims.head_dim {
        return Err(KernelError::Shape {
            arg: "key",
            expected: format!(
                "[{}, KH, KV, {}] (batch and head_dim of query)",
                dims.batch, dims.head_dim
            ),
            got: k.shape.clone(),
        });
    }
    expect_shape("value", &v, &kv_shape)?;
    expect_shape("kv_lens", &lens, &[dims.batch])?;
    check_dims(client, dims)?;
    Ok(Checked {
        dt,
        dims,
        q,
        k,
        v,
        lens,
        causal: inp.causal,
        scale: inp.scale,
    })
}

/// Shared memory (bytes) the largest of the kernels takes.
fn shared_bytes() -> usize {
    let rows = 4 * UNITS;
    let forward = STAGE_LEN + rows * S_PAD + 5 * rows;
    let dkv = STAGE_LEN + 2 * rows * DKV_PAD + 3 * 32;
    4 * forward.max(dkv)
}

fn check_dims<R: Runtime>(client: &ComputeClient<R>, d: AttentionDims) -> Result<(), KernelError> {
    if d.head_dim > ATTENTION_MAX_HEAD_DIM {
        return Err(KernelError::Unsupported {
            what: "attention",
            reason: format!(
                "head_dim {} exceeds ATTENTION_MAX_HEAD_DIM = {ATTENTION_MAX_HEAD_DIM}",
                d.head_dim
            ),
        });
    }
    if !d.heads.is_multiple_of(d.kv_heads) {
        return Err(KernelError::Shape {
            arg: "key",
            expected: format!("KV heads dividing the {} query heads", d.heads),
            got: vec![d.batch, d.kv_heads, d.kv_len, d.head_dim],
        });
    }
    let prod = |xs: &[usize]| xs.iter().try_fold(1usize, |a, &x| a.checked_mul(x));
    let count = |arg: &'static str, what: &'static str, xs: &[usize]| {
        to_u32(arg, what, prod(xs).unwrap_or(usize::MAX))
    };
    count(
        "query",
        "elements of query / out / grad_query",
        &[d.batch, d.heads, d.q_len, d.head_dim],
    )?;
    count(
        "key",
        "elements of key / value / their gradients",
        &[d.batch, d.kv_heads, d.kv_len, d.head_dim],
    )?;
    count(
        "query",
        "u32 elements of the backward's workspace (3·B·H·Q)",
        &[3, d.batch, d.heads, d.q_len],
    )?;
    // Cube indices (split over launches along x where the runtime's count is smaller).
    count(
        "query",
        "cubes of the query-row kernels",
        &[d.batch, d.kv_heads, (d.group() * d.q_len).div_ceil(UNITS)],
    )?;
    count(
        "key",
        "cubes of the dK/dV kernel",
        &[d.batch, d.kv_heads, d.kv_len.div_ceil(UNITS)],
    )?;
    to_u32("key", "KV", d.kv_len)?;
    to_u32("query", "Q", d.q_len)?;
    let hw = &client.properties().hardware;
    if (hw.max_units_per_cube as usize) < THREADS
        || (hw.max_cube_dim.0 as usize) < UNITS
        || (hw.max_cube_dim.1 as usize) < UNITS
    {
        return Err(KernelError::Unsupported {
            what: "attention",
            reason: format!(
                "needs cubes of {UNITS}×{UNITS} units, the device allows {:?} (at most {} units)",
                hw.max_cube_dim, hw.max_units_per_cube
            ),
        });
    }
    if hw.max_shared_memory_size < shared_bytes() {
        return Err(KernelError::Unsupported {
            what: "attention",
            reason: format!(
                "needs {} bytes of shared memory per cube, the device has {}",
                shared_bytes(),
                hw.max_shared_memory_size
            ),
        });
    }
    Ok(())
}

/// The attention kernels' limits for `dims` on this client (see [`crate::attention::attention_limits`]).
pub(crate) fn limits<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
) -> Result<(), KernelError> {
    check_dims(client, dims)
}

/// Layouts of the tensors one kernel takes (`None`: not taken, zeros).
#[derive(Default)]
pub(crate) struct Layouts<'a> {
    pub q: Option<&'a View>,
    pub k: Option<&'a View>,
    pub v: Option<&'a View>,
    pub o: Option<&'a View>,
    pub go: Option<&'a View>,
    pub gq: Option<&'a View>,
    pub gk: Option<&'a View>,
    pub gv: Option<&'a View>,
    pub lse: Option<&'a View>,
}

/// The forward's tensor inputs as one launch argument.
pub(crate) fn attn_inputs<F: Float, R: Runtime>(
    inputs: &AttentionRefs<'_, R>,
) -> AttnInputsLaunch<F, R> {
    AttnInputsLaunch::new(
        raw_arg(inputs.query),
        raw_arg(inputs.key),
        raw_arg(inputs.value),
        raw_arg(inputs.kv_lens),
    )
}

/// The dQ and dK/dV kernels' tensor inputs as one launch argument.
pub(crate) fn grad_inputs<F: Float, R: Runtime>(
    inputs: &AttentionRefs<'_, R>,
    grads: &AttentionGradRefs<'_, R>,
) -> GradInputsLaunch<F, R> {
    GradInputsLaunch::new(
        raw_arg(inputs.query),
        raw_arg(inputs.key),
        raw_arg(inputs.value),
        raw_arg(grads.grad_out),
        raw_arg(grads.workspace),
    )
}

fn strides<R: Runtime>(v: Option<&View>) -> Strides4Launch<R> {
    let s = |d: usize| v.and_then(|v| v.strides.get(d)).map_or(0, |&x| x as u32);
    Strides4Launch::new(s(0), s(1), s(2), s(3))
}

impl Checked {
    /// The layouts of the query, key and value.
    pub(crate) fn layouts(&self) -> Layouts<'_> {
        Layouts {
            q: Some(&self.q),
            k: Some(&self.k),
            v: Some(&self.v),
            ..Default::default()
        }
    }

    /// The compile-time configuration with `rows` rows per unit.
    pub(crate) fn cfg<R: Runtime>(&self, client: &ComputeClient<R>, rows: usize) -> AttnCfg {
        AttnCfg {
            d: self.dims.head_dim,
            rows,
            causal: self.causal,
            emulate: fma_mode(client) == FmaMode::Emulated,
            splits: false,
        }
    }
}

impl Layouts<'_> {
    /// The kernels' parameters, for a launch starting at cube (or row) `offset`.
    pub(crate) fn params<R: Runtime>(&self, c: &Checked, offset: usize) -> AttnParamsLaunch<R> {
        let d = c.dims;
        AttnParamsLaunch::new(
            strides(self.q),
            strides(self.k),
            strides(self.v),
            strides(self.o),
            strides(self.go),
            strides(self.gq),
            strides(self.gk),
            strides(self.gv),
            strides(self.lse),
            c.lens.stride(0) as u32,
            d.batch as u32,
            d.heads as u32,
            d.kv_heads as u32,
            d.group() as u32,
            d.q_len as u32,
            d.kv_len as u32,
            c.scale,
            offset as u32,
        )
    }
}
