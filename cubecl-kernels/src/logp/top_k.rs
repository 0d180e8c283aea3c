//! `linear_top_k`: the sampler's own pass without noise, each row's `k` largest tempered logits
//! and their columns written out instead of a draw. Tensor parallelism merges the shards' lists.

use super::candidates::{NO_TOKEN, merged_lists, unrolled_insert};
use super::inputs::{LogpInputRefs, check_workspace, view};
use super::sample::{MERGE_BLOCK, SampleSpec, candidate_pass, check_sample};
use super::workspace::partials_len;
use crate::error::KernelError;
use crate::gemm::view::{MatArg, MatArgLaunch};
use crate::util::{check_grid, check_out_view, expect_shape, raw_arg, to_u32};
use cubecl::prelude::*;

/// Each row's `k` largest tempered logits, best first (larger logit, on equal ones the smaller
/// column), and their columns: `out [N, 2k]` f32, `(z_1 … z_k, j_1 … j_k)`; a slot with no
/// candidate (fewer than `k` columns with a logit above −∞ and not NaN) has `z = −∞`, `j = −1`.
/// The logits are bitwise those [`super::linear_sample_forward`] ranks (the `linear_logp`
/// forward's), and a column's depends on it alone, not on the other columns of `weight`: the lists
/// of vocabulary shards merge to the list of the whole. `inputs.targets` is any `[N]` integer
/// tensor (unread values), `inputs.ignore_index` must be `None`; `1 ≤ k ≤ SAMPLE_K_MAX`,
/// `V ≤ 2²⁴`; `workspace` as `linear_sample_workspace_len(N, V, dtype, k)`.
pub fn linear_top_k_forward<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    k: u32,
    out: &TensorBinding<R>,
    workspace: &TensorBinding<R>,
) -> Result<(), KernelError> {
    let spec = SampleSpec {
        seed: 0,
        k,
        noise: false,
    };
    let c = check_sample(client, inputs, spec)?;
    let ov = check_out_view("out", out, 2, 4)?;
    expect_shape("out", &ov, &[c.n, 2 * k as usize])?;
    let ws_len = super::linear_sample_workspace_len(c.n, c.v, inputs.dtype, k);
    check_workspace(workspace, ws_len)?;
    to_u32("workspace", "length", ws_len)?;
    if c.n == 0 {
        return Ok(());
    }
    let lists = candidate_pass(client, inputs, &c, spec, workspace)?;
    let (gx, _) = check_grid(client, "hidden", c.n.div_ceil(MERGE_BLOCK), 1)?;
    unsafe {
        top_k_merge_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, 1, 1),
            CubeDim::new_1d(MERGE_BLOCK as u32),
            raw_arg(workspace),
            MatArgLaunch::new(raw_arg(out), view(ov.stride(0), ov.stride(1), 0)),
            TopKMergeScalarsLaunch::new(c.n as u32, lists as u32, partials_len(c.n, c.v) as u32),
            k,
            unrolled_insert(client),
        );
    }
    Ok(())
}

/// The merge's scalars: rows, candidate lists per row, where the candidates lie.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct TopKMergeScalars {
    pub n_rows: u32,
    pub lists: u32,
    pub cand_off: u32,
}

/// One unit per row: the row's lists merged into its `k` best, written as `(z…, j…)`.
#[cube(launch_unchecked)]
pub(crate) fn top_k_merge_kernel(
    ws: &Tensor<f32>,
    out: &mut MatArg<f32>,
    sc: TopKMergeScalars,
    #[comptime] k: u32,
    #[comptime] unrolled: bool,
) {
    let kk = comptime![k as usize];
    let n = sc.n_rows as usize;
    let row = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if row < n {
        let list = merged_lists(ws, sc.cand_off, n, row, sc.lists as usize, k, unrolled);
        let base = out.view.offset as usize + row * out.view.s0 as usize;
        let s1 = out.view.s1 as usize;
        #[unroll]
        for e in 0..kk {
            let j = list.idx[e];
            out.buf[base + e * s1] = list.z[e];
            out.buf[base + (kk + e) * s1] =
                select(j != NO_TOKEN, f32::cast_from(j), f32::new(-1.0));
        }
    }
}
