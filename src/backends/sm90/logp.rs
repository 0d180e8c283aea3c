//! The SM90 fused linear log-prob (`kernels/linear_logp_sm90.cu`): the forward over fixed
//! vocabulary segments plus their merge, and the chunked backward of kernels/README.md
//! ("Backward"): per (vocabulary chunk, token chunk) the `dz` tile, the `dBias` partials, then
//! `dHidden` and `dWeight` as GEMMs accumulated in f32 over the chunks in ascending order.
use burn::tensor::{DType, FloatDType, Shape, ops::FloatTensorOps};
use burn_cubecl::kernel::into_contiguous;
use cubecl::server::Binding;

use super::gemm::{GEMM_ACC_LOAD, GEMM_ACC_STORE, GEMM_STORE_C, GemmOut, Layout, gemm_launch};
use super::nvrtc::launch;
use super::operand::TmaOperand;
use super::params::{LogpBwdParams, LogpFwdParams, LogpSampleParams};
use super::sm_count;
use super::table::{Entry, constant, entry, lookup};
use crate::backend::LogpHead;
use crate::backends::alloc::{empty, zeros};
use crate::backends::cuda::{CudaOps, CudaTensor};
use cubecl::{client::ComputeClient, cuda::CudaRuntime};

/// Token rows of one backward chunk (part of the numerics: `dWeight` sums chunks in order).
const TOKEN_CHUNK: usize = constant("TOKEN_CHUNK");
/// Vocabulary columns of one backward chunk (part of the numerics: `dHidden` sums chunks in
/// order); also the row stride of the `dz` scratch.
const VOCAB_CHUNK: usize = constant("VOCAB_CHUNK");
/// Vocabulary columns of one forward segment of `ib_logp_fwd` (`LOGP_SEG` in the source).
const FWD_SEGMENT_COLS: usize = constant("LOGP_SEG");

const LOGP_HAS_BIAS: u32 = constant("LOGP_HAS_BIAS") as u32;
const LOGP_HAS_IGNORE: u32 = constant("LOGP_HAS_IGNORE") as u32;
const DBIAS_ACC_LOAD: u32 = constant("LOGP_DBIAS_ACC_LOAD") as u32;
const DBIAS_ACC_STORE: u32 = constant("LOGP_DBIAS_ACC_STORE") as u32;
const DBIAS_STORE: u32 = constant("LOGP_DBIAS_STORE") as u32;
const LOGP_ENTROPY: u32 = constant("LOGP_ENTROPY") as u32;

/// The forward's segment merge: one warp per row.
const MERGE: Entry = lookup("ib_logp_merge");
/// The sampler's merge: one warp per row.
const SAMPLE_MERGE: Entry = lookup("ib_logp_sample_merge");
/// Token rows of one `dz` tile: `dbias_part` holds one row of column sums per such block.
const DZ_ROW_BLOCK: usize = lookup("ib_logp_bwd_dz_bf16").tile[0];

/// The kernels' dtype suffix.
fn is_bf16(dtype: DType) -> bool {
    match dtype {
        DType::BF16 => true,
        DType::F16 => false,
        other => unreachable!("the registry admits only bf16/f16 for Sm90, got {other:?}"),
    }
}

/// Targets as contiguous i32 with ignored rows mapped to −1 (never a valid target), so an
/// ignore index outside the i32 range still matches exactly. Values of a wider dtype outside
/// `[0, vocab)` become −2 before the narrowing, so none can turn into a class.
fn normalized_targets(
    targets: CudaTensor,
    ignore_index: Option<i64>,
    vocab: usize,
) -> (CudaTensor, Option<i64>) {
    use burn::tensor::{BoolDType, IntDType, ops::BoolTensorOps, ops::IntTensorOps};
    let narrow = |t: CudaTensor| match t.dtype {
        DType::I32 => t,
        _ => CudaOps::int_cast(t, IntDType::I32),
    };
    if ignore_index == Some(-1) && targets.dtype == DType::I32 {
        // Nothing to remap or narrow (the TP leaves' usual form).
        return (into_contiguous(targets), Some(-1));
    }
    let is_ignored = ignore_index
        .map(|ignore| CudaOps::int_equal_elem(targets.clone(), ignore.into(), BoolDType::U8));
    let mut targets = targets;
    if targets.dtype == DType::I32 && is_ignored.is_some() {
        // −1 becomes the ignore sentinel below: a raw −1 (unchecked, out of range) is −2.
        let minus_one = CudaOps::int_equal_elem(targets.clone(), (-1i64).into(), BoolDType::U8);
        targets = CudaOps::int_mask_fill(targets, minus_one, (-2i64).into());
    }
    if targets.dtype != DType::I32 {
        let below = CudaOps::int_lower_elem(targets.clone(), 0i64.into(), BoolDType::U8);
        let vocab = (vocab as i64).into();
        let above = CudaOps::int_greater_equal_elem(targets.clone(), vocab, BoolDType::U8);
        let beyond = CudaOps::bool_or(below, above);
        targets = CudaOps::int_mask_fill(targets, beyond, (-2i64).into());
    }
    if let Some(is_ignored) = is_ignored {
        targets = CudaOps::int_mask_fill(targets, is_ignored, (-1i64).into());
    }
    (into_contiguous(narrow(targets)), ignore_index.map(|_| -1))
}

fn logp_flags(bias: bool, ignore_index: Option<i64>, head: LogpHead) -> u32 {
    (if bias { LOGP_HAS_BIAS } else { 0 })
        | ignore_index.map_or(0, |_| LOGP_HAS_IGNORE)
        | if head.entropy { LOGP_ENTROPY } else { 0 }
}

/// Rows up to which a forward pass runs its ping-pong kernel (`ib_logp_{fwd,sample}_pp_*`: 64-row
/// work items, one consumer's epilogue beside the other's MMAs), past which the 128-row one (each W
/// tile read for twice the rows: the ping-pong kernels are bound by L2 there). The sampler's pass,
/// whose epilogue (the noise, the candidates) is the heavier, gains up to twice as many rows.
/// Both kernels give every row the same bits, so the choice by N keeps every invariance. Measured
/// in `benches/results/sample-h100.md` (2026-11-28, 19:54 and 23:36 UTC).
fn pingpong_max_rows(stem: &str) -> usize {
    match stem {
        "sample" => 4096,
        _ => 2048,
    }
}

/// The entry `<stem>[_pp][_ent]_<dtype>` of the `linear_logp` kernels.
fn logp_entry(stem: &str, pingpong: bool, dtype: DType, head: LogpHead) -> Entry {
    match (stem, pingpong, head.entropy, is_bf16(dtype)) {
        ("fwd", false, false, true) => entry!("ib_logp_fwd_bf16"),
        ("fwd", false, false, false) => entry!("ib_logp_fwd_f16"),
        ("fwd", false, true, true) => entry!("ib_logp_fwd_ent_bf16"),
        ("fwd", false, true, false) => entry!("ib_logp_fwd_ent_f16"),
        ("fwd", true, false, true) => entry!("ib_logp_fwd_pp_bf16"),
        ("fwd", true, false, false) => entry!("ib_logp_fwd_pp_f16"),
        ("fwd", true, true, true) => entry!("ib_logp_fwd_pp_ent_bf16"),
        ("fwd", true, true, false) => entry!("ib_logp_fwd_pp_ent_f16"),
        ("sample", false, false, true) => entry!("ib_logp_sample_bf16"),
        ("sample", false, false, false) => entry!("ib_logp_sample_f16"),
        ("sample", false, true, true) => entry!("ib_logp_sample_ent_bf16"),
        ("sample", false, true, false) => entry!("ib_logp_sample_ent_f16"),
        ("sample", true, false, true) => entry!("ib_logp_sample_pp_bf16"),
        ("sample", true, false, false) => entry!("ib_logp_sample_pp_f16"),
        ("sample", true, true, true) => entry!("ib_logp_sample_pp_ent_bf16"),
        ("sample", true, true, false) => entry!("ib_logp_sample_pp_ent_f16"),
        ("bwd_dz", false, false, true) => entry!("ib_logp_bwd_dz_bf16"),
        ("bwd_dz", false, false, false) => entry!("ib_logp_bwd_dz_f16"),
        ("bwd_dz", false, true, true) => entry!("ib_logp_bwd_dz_ent_bf16"),
        ("bwd_dz", false, true, false) => entry!("ib_logp_bwd_dz_ent_f16"),
        (other, ..) => unreachable!("no linear_logp entry `{other}` (ping-pong {pingpong})"),
    }
}

/// The inputs of either direction, as the kernels take them.
pub(crate) struct LogpArgs {
    pub hidden: CudaTensor,
    pub weight: CudaTensor,
    pub bias: Option<CudaTensor>,
    pub targets: CudaTensor,
    pub ignore_index: Option<i64>,
    pub head: LogpHead,
}

impl LogpArgs {
    /// `(N, D, V)`.
    fn sizes(&self) -> (usize, usize, usize) {
        let [n, d] = [0, 1].map(|i| self.hidden.meta.shape()[i]);
        (n, d, self.weight.meta.shape()[0])
    }
}

/// A forward pass (`stem` `fwd` or `sample`) over `n` rows and `segments` vocabulary segments: the
/// ping-pong entry up to [`pingpong_max_rows`], else the 128-row one, and its persistent grid
/// of one CTA cluster per work item (per two with ping-pong, one per consumer), at most the SMs'
/// worth.
fn forward_pass(
    stem: &str,
    (n, segments): (usize, usize),
    dtype: DType,
    head: LogpHead,
    client: &ComputeClient<CudaRuntime>,
) -> (Entry, usize) {
    let pingpong = n <= pingpong_max_rows(stem);
    let pass = logp_entry(stem, pingpong, dtype, head);
    let cluster = pass.cluster;
    let items = n.div_ceil(pass.tile[0]).div_ceil(cluster) * segments;
    let at_once = if pingpong { 2 } else { 1 };
    let clusters = items
        .div_ceil(at_once)
        .min(sm_count(client) / cluster)
        .max(1);
    (pass, cluster * clusters)
}

/// f32 `[n]` outputs joined as the columns of `[n, C]`.
fn joined(n: usize, columns: impl Iterator<Item = CudaTensor>) -> CudaTensor {
    let column = |t: CudaTensor| CudaOps::float_reshape(t, Shape::new([n, 1]));
    CudaOps::float_cat(columns.map(column).collect(), 1)
}

/// The sampler in one pass (Gumbel-max with `noise`, argmax without): `[N, C + 1]` f32
/// `(logp, lse[, entropy], token)` for the row keys in `args.targets` (any integer dtype, taken
/// modulo 2³²). The pass is the forward's (same tiles, same partials, same merge tree), so `lse`,
/// `entropy` and `logp = z_token − lse` are [`linear_logp`]'s bits for `targets = tokens`.
pub(crate) fn linear_sample(args: LogpArgs, seed: u64, noise: bool) -> CudaTensor {
    use burn::tensor::{IntDType, ops::IntTensorOps};
    let (n, d, v) = args.sizes();
    let LogpArgs {
        hidden,
        weight,
        bias,
        targets: keys,
        head,
        ..
    } = args;
    let (dtype, client) = (hidden.dtype, hidden.client.clone());
    let out = |len: usize| empty(&hidden, vec![len], DType::F32);
    // The merge writes each row's (logp, lse[, entropy], token) in place.
    let stats = empty(&hidden, vec![n, head.columns() + 1], DType::F32);
    let segments = v.div_ceil(FWD_SEGMENT_COLS);
    let workspace = out(segments * n * 2);
    let candidates = out(segments * n * 4);
    let shifted = head.entropy.then(|| out(segments * n));
    let keys = match keys.dtype {
        DType::I32 => keys,
        _ => CudaOps::int_cast(keys, IntDType::I32),
    };
    let keys = into_contiguous(keys);
    let bias = bias.map(into_contiguous);
    let (h, w) = (TmaOperand::new(hidden), TmaOperand::new(weight));
    let params = LogpSampleParams {
        n: n as u32,
        v: v as u32,
        d: d as u32,
        flags: logp_flags(bias.is_some(), None, head),
        ignore_index: 0,
        inv_t: head.inv_temperature,
        pad: 0,
        seed_lo: seed as u32,
        seed_hi: (seed >> 32) as u32,
        noise: u32::from(noise),
        pad2: 0,
    };
    let binding = |t: &CudaTensor| t.handle.clone().binding();
    let any = &workspace;
    let shifted_binding = binding(shifted.as_ref().unwrap_or(any));
    let bias_binding = bias.as_ref().map_or_else(|| h.binding(), binding);
    let (pass, grid) = forward_pass("sample", (n, segments), dtype, head, &client);
    launch(
        &client,
        pass,
        grid,
        vec![h.map(0, n), w.map(0, v)],
        vec![
            h.binding(),
            w.binding(),
            bias_binding,
            binding(&keys),
            binding(&workspace),
            shifted_binding.clone(),
            binding(&candidates),
        ],
        &params,
    );
    launch(
        &client,
        SAMPLE_MERGE,
        n.div_ceil(SAMPLE_MERGE.tile[0]),
        vec![],
        vec![
            binding(&stats),
            binding(&workspace),
            shifted_binding,
            binding(&candidates),
        ],
        &params,
    );
    stats
}

/// Forward: `[N, C]` f32 `(logp, lse[, entropy])`.
pub(crate) fn linear_logp(args: LogpArgs) -> CudaTensor {
    let (n, d, v) = args.sizes();
    let LogpArgs {
        hidden,
        weight,
        bias,
        targets,
        ignore_index,
        head,
    } = args;
    let (dtype, client) = (hidden.dtype, hidden.client.clone());
    // The owning CTA writes z_t into logp; rows whose target matches no column keep NaN.
    let logp = CudaOps::float_full(
        Shape::new([n]),
        f32::NAN.into(),
        &hidden.device,
        FloatDType::F32,
    );
    let lse = empty(&hidden, vec![n], DType::F32);
    let segments = v.div_ceil(FWD_SEGMENT_COLS);
    let workspace = empty(&hidden, vec![segments * n * 2], DType::F32);
    // The shifted sums and the entropy exist only when asked for; otherwise any live buffer.
    let shifted = head
        .entropy
        .then(|| empty(&hidden, vec![segments * n], DType::F32));
    let entropy = head.entropy.then(|| empty(&hidden, vec![n], DType::F32));
    let (targets, ignore_index) = normalized_targets(targets, ignore_index, v);
    let bias = bias.map(into_contiguous);
    let (h, w) = (TmaOperand::new(hidden), TmaOperand::new(weight));
    let params = LogpFwdParams {
        n: n as u32,
        v: v as u32,
        d: d as u32,
        flags: logp_flags(bias.is_some(), ignore_index, head),
        ignore_index: ignore_index.unwrap_or(0),
        inv_t: head.inv_temperature,
        pad: 0,
    };
    let outputs = || {
        let any = &workspace;
        [
            &targets,
            &logp,
            &lse,
            &workspace,
            shifted.as_ref().unwrap_or(any),
            entropy.as_ref().unwrap_or(any),
        ]
        .map(|t| t.handle.clone().binding())
    };
    let bias_binding = bias
        .as_ref()
        .map_or_else(|| h.binding(), |b| b.handle.clone().binding());
    let mut buffers = vec![h.binding(), w.binding(), bias_binding];
    buffers.extend(outputs());
    let (forward, grid) = forward_pass("fwd", (n, segments), dtype, head, &client);
    launch(
        &client,
        forward,
        grid,
        vec![h.map(0, n), w.map(0, v)],
        buffers,
        &params,
    );
    launch(
        &client,
        MERGE,
        n.div_ceil(MERGE.tile[0]),
        vec![],
        outputs().to_vec(),
        &params,
    );
    joined(n, [Some(logp), Some(lse), entropy].into_iter().flatten())
}

/// Flags of chunk `index` of `count` in an f32 accumulation over chunks: load the running sum
/// after the first, store it before the last, write the rounded result at the last.
fn chunk_flags(index: usize, count: usize, [load, store, finish]: [u32; 3]) -> u32 {
    let mut flags = 0;
    if index > 0 {
        flags |= load;
    }
    if index + 1 < count {
        flags |= store;
    } else {
        flags |= finish;
    }
    flags
}

/// Gradients of the backward: `(dHidden, dWeight, dBias)`.
pub(crate) type LogpGradTensors = (CudaTensor, CudaTensor, Option<CudaTensor>);

/// One (vocabulary chunk, token chunk) of the backward.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    vi: usize,
    ti: usize,
    v0: usize,
    vw: usize,
    t0: usize,
    tw: usize,
}

/// Everything the backward's chunk launches read and write.
struct Backward {
    dtype: DType,
    d: usize,
    chunks: [usize; 2],
    h: TmaOperand,
    w: TmaOperand,
    bias: Option<CudaTensor>,
    targets: CudaTensor,
    ignore_index: Option<i64>,
    head: LogpHead,
    /// The forward's lse, the upstream `dLogp` and `dLse`, then the forward's entropy and the
    /// upstream `dEntropy` (these two only with `head.entropy`).
    columns: [Option<CudaTensor>; 5],
    /// `dz` of the live chunk: `[min(N, TOKEN_CHUNK), VOCAB_CHUNK]`.
    dz: TmaOperand,
    /// `hidden` with the rows whose upstream gradients are all zero set to 0: the `dWeight`
    /// product's operand, so such rows add exactly nothing even when they hold NaN / Inf.
    h_live: TmaOperand,
    dbias_part: CudaTensor,
    /// f32 running sums of the accumulations over chunks, where there is more than one.
    dh_acc: Option<CudaTensor>,
    dw_acc: Option<CudaTensor>,
    db_acc: Option<CudaTensor>,
    grads: LogpGradTensors,
}

impl Backward {
    /// Splits the stats and upstream gradient into columns and allocates the bounded scratch.
    fn prepare(args: LogpArgs, stats: CudaTensor, grad: CudaTensor) -> Self {
        let (n, d, v) = args.sizes();
        let LogpArgs {
            hidden,
            weight,
            bias,
            targets,
            ignore_index,
            head,
        } = args;
        let dtype = hidden.dtype;
        let column = |t: &CudaTensor, c: usize| {
            let col = CudaOps::float_slice(t.clone(), &[(0..n).into(), (c..c + 1).into()]);
            into_contiguous(CudaOps::float_reshape(
                into_contiguous(col),
                Shape::new([n]),
            ))
        };
        let entropy = |t: &CudaTensor| head.entropy.then(|| column(t, 2));
        let upstream = [column(&grad, 0), column(&grad, 1)];
        let g_ent = entropy(&grad);
        let (targets, ignore_index) = normalized_targets(targets, ignore_index, v);
        let live = live_rows(
            hidden.clone(),
            &upstream,
            g_ent.as_ref(),
            &targets,
            ignore_index,
        );
        let [g_logp, g_lse] = upstream;
        // In the kernel's argument order: lse, dLogp, dLse, entropy, dEntropy.
        let columns = [
            Some(column(&stats, 1)),
            Some(g_logp),
            Some(g_lse),
            entropy(&stats),
            g_ent,
        ];
        let bias = bias.map(into_contiguous);
        let grads = (
            empty(&hidden, vec![n, d], dtype),
            empty(&weight, vec![v, d], dtype),
            bias.as_ref().map(|b| empty(b, vec![v], b.dtype)),
        );
        let chunks = [v.div_ceil(VOCAB_CHUNK), n.div_ceil(TOKEN_CHUNK)];
        let rows = n.min(TOKEN_CHUNK);
        Self {
            dtype,
            d,
            chunks,
            dz: TmaOperand::new(empty(&hidden, vec![rows, VOCAB_CHUNK], dtype)),
            dbias_part: empty(
                &hidden,
                vec![rows.div_ceil(DZ_ROW_BLOCK) * VOCAB_CHUNK],
                DType::F32,
            ),
            dh_acc: (chunks[0] > 1).then(|| empty(&hidden, vec![n, d], DType::F32)),
            dw_acc: (chunks[1] > 1).then(|| empty(&weight, vec![v, d], DType::F32)),
            db_acc: bias
                .as_ref()
                .filter(|_| chunks[1] > 1)
                .map(|b| empty(b, vec![v], DType::F32)),
            h: TmaOperand::new(hidden),
            h_live: TmaOperand::new(live),
            w: TmaOperand::new(weight),
            bias,
            targets,
            ignore_index,
            head,
            columns,
            grads,
        }
    }

    fn params(&self, chunk: Chunk) -> LogpBwdParams {
        let mut flags = logp_flags(self.bias.is_some(), self.ignore_index, self.head);
        if self.bias.is_some() {
            let dbias = [DBIAS_ACC_LOAD, DBIAS_ACC_STORE, DBIAS_STORE];
            flags |= chunk_flags(chunk.ti, self.chunks[1], dbias);
        }
        LogpBwdParams {
            tw: chunk.tw as u32,
            vw: chunk.vw as u32,
            d: self.d as u32,
            flags,
            ignore_index: self.ignore_index.unwrap_or(0),
            t0: chunk.t0 as u32,
            v0: chunk.v0 as u32,
            ldz: VOCAB_CHUNK as u32,
            inv_t: self.head.inv_temperature,
        }
    }

    /// A bound buffer, or any live buffer where the kernel reads nothing.
    fn or_any(&self, t: Option<&CudaTensor>) -> Binding {
        t.map_or_else(|| self.h.binding(), |t| t.handle.clone().binding())
    }

    /// `dz = ((dLse − dLogp)·p + dLogp·onehot − dEntropy·p·(z − lse + H)) / T` of the chunk,
    /// and its dBias row-block partials.
    fn launch_dz(&self, chunk: Chunk) {
        let client = &self.grads.0.client;
        let mut buffers = vec![
            self.h.binding(),
            self.w.binding(),
            self.or_any(self.bias.as_ref()),
            self.targets.handle.clone().binding(),
        ];
        buffers.extend(self.columns.iter().map(|c| self.or_any(c.as_ref())));
        buffers.extend([self.dz.binding(), self.dbias_part.handle.clone().binding()]);
        let kernel = logp_entry("bwd_dz", false, self.dtype, self.head);
        let ([rows, cols], cluster) = (kernel.tile, kernel.cluster);
        let tiles = chunk.tw.div_ceil(rows).div_ceil(cluster) * chunk.vw.div_ceil(cols);
        let grid = cluster * tiles.min(sm_count(client) / cluster).max(1);
        let maps = vec![
            self.h.map(chunk.t0, chunk.tw),
            self.w.map(chunk.v0, chunk.vw),
        ];
        launch(client, kernel, grid, maps, buffers, &self.params(chunk));
    }

    /// dBias of the chunk's columns: its row-block partials in ascending order, added to the
    /// running sum of the earlier token chunks.
    fn reduce_dbias(&self, chunk: Chunk) {
        let client = &self.grads.0.client;
        let kernel = if is_bf16(self.dtype) {
            entry!("ib_logp_bwd_dbias_bf16")
        } else {
            entry!("ib_logp_bwd_dbias_f16")
        };
        let buffers = vec![
            self.dbias_part.handle.clone().binding(),
            self.or_any(self.db_acc.as_ref()),
            self.or_any(self.grads.2.as_ref()),
        ];
        launch(
            client,
            kernel,
            chunk.vw.div_ceil(kernel.tile[1]),
            vec![],
            buffers,
            &self.params(chunk),
        );
    }

    /// `dH[t0..t0+tw] (+)= dz · W[v0..v0+vw]` (the reduction over this vocabulary chunk) or
    /// `dW[v0..v0+vw] (+)= dzᵀ · H[t0..t0+tw]` (over this token chunk), in f32 across chunks.
    fn accumulate(&self, chunk: Chunk, target: Gradient) {
        let (layout, c, acc, [index, count], c_row) = match target {
            Gradient::Hidden => {
                let position = [chunk.vi, self.chunks[0]];
                (Layout::Nn, &self.grads.0, &self.dh_acc, position, chunk.t0)
            }
            Gradient::Weight => {
                let position = [chunk.ti, self.chunks[1]];
                (Layout::Tn, &self.grads.1, &self.dw_acc, position, chunk.v0)
            }
        };
        let (other, [m, k]) = match target {
            Gradient::Hidden => (
                (&self.w, self.w.map(chunk.v0, chunk.vw)),
                [chunk.tw, chunk.vw],
            ),
            Gradient::Weight => (
                (&self.h_live, self.h_live.map(chunk.t0, chunk.tw)),
                [chunk.vw, chunk.tw],
            ),
        };
        let out = GemmOut {
            c,
            acc: acc.as_ref(),
            bias: None,
            flags: chunk_flags(index, count, [GEMM_ACC_LOAD, GEMM_ACC_STORE, GEMM_STORE_C]),
            ldc: self.d,
            c_offset: c_row * self.d,
        };
        // dz's map covers only the live chunk: tw rows × vw columns.
        let dz = (&self.dz, self.dz.map_columns(0, chunk.tw, chunk.vw));
        gemm_launch(layout, self.dtype, (dz, other), [m, self.d, k], out);
    }
}

/// `hidden` with the rows whose upstream gradients are all zero, as the `dz` kernel decides
/// (`dLogp` and `dEntropy` dropped for ignored rows), set to 0.
fn live_rows(
    hidden: CudaTensor,
    [g_logp, g_lse]: &[CudaTensor; 2],
    g_ent: Option<&CudaTensor>,
    targets: &CudaTensor,
    ignore_index: Option<i64>,
) -> CudaTensor {
    use burn::tensor::{BoolDType, ops::BoolTensorOps, ops::IntTensorOps};
    let shape = hidden.meta.shape().to_vec();
    let nonzero =
        |t: &CudaTensor| CudaOps::float_not_equal_elem(t.clone(), 0.0f32.into(), BoolDType::U8);
    // The upstream dLogp and dEntropy, where present, count only on rows that are not ignored.
    let counted = |t: &CudaTensor| match ignore_index {
        Some(ignore) => CudaOps::bool_and(
            nonzero(t),
            CudaOps::int_not_equal_elem(targets.clone(), ignore.into(), BoolDType::U8),
        ),
        None => nonzero(t),
    };
    let mut live = CudaOps::bool_or(nonzero(g_lse), counted(g_logp));
    if let Some(g_ent) = g_ent {
        live = CudaOps::bool_or(live, counted(g_ent));
    }
    let dead = CudaOps::bool_not(live);
    let dead = CudaOps::bool_reshape(dead, Shape::new([shape[0], 1]));
    let dead = CudaOps::bool_expand(dead, Shape::from(shape));
    CudaOps::float_mask_fill(hidden, dead, 0.0f32.into())
}

/// The gradient a chunk GEMM accumulates.
#[derive(Debug, Clone, Copy)]
enum Gradient {
    Hidden,
    Weight,
}

/// Backward from the forward's `stats [N, C]` and the upstream `grad [N, C]`.
pub(crate) fn linear_logp_backward(
    args: LogpArgs,
    stats: CudaTensor,
    grad: CudaTensor,
) -> LogpGradTensors {
    let (n, d, v) = args.sizes();
    // D ≥ 1 here: the Sm90 kernels refuse D = 0 (`check_problem`), which runs elsewhere.
    if n == 0 {
        let dtype = args.hidden.dtype;
        return (
            zeros(&args.hidden, vec![n, d], dtype),
            zeros(&args.weight, vec![v, d], dtype),
            args.bias.as_ref().map(|b| zeros(b, vec![v], b.dtype)),
        );
    }
    let backward = Backward::prepare(args, stats, grad);
    let [vocab_chunks, token_chunks] = backward.chunks;
    for vi in 0..vocab_chunks {
        let (v0, vw) = (vi * VOCAB_CHUNK, VOCAB_CHUNK.min(v - vi * VOCAB_CHUNK));
        for ti in 0..token_chunks {
            let (t0, tw) = (ti * TOKEN_CHUNK, TOKEN_CHUNK.min(n - ti * TOKEN_CHUNK));
            let chunk = Chunk {
                vi,
                ti,
                v0,
                vw,
                t0,
                tw,
            };
            backward.launch_dz(chunk);
            if backward.bias.is_some() {
                backward.reduce_dbias(chunk);
            }
            backward.accumulate(chunk, Gradient::Hidden);
            backward.accumulate(chunk, Gradient::Weight);
        }
    }
    backward.grads
}
