//! The public `attention` and `attention_with_lens`: validation, the registry's choice, the
//! primitive.
use burn::tensor::{Int, Tensor, TensorData};

use super::{AttentionInputs, AttentionOptions};
use crate::backend::Problem;
use crate::backends::generic::{float_primitive, float_tensor};
use crate::registry::{check_device, implementation_for_problem};
use crate::{InvariantBackend, InvariantError, validate};

/// Deterministic, batch-invariant attention: `softmax(q·kᵀ·scale)·v` per query over the keys
/// it sees, with grouped KV heads.
///
/// `query [B, H, Q, Dh]`, `key`/`value [B, KH, KV, Dh]` with `H % KH == 0` (query head `h`
/// reads KV head `h / (H / KH)`), `kv_lens [B]` the valid keys of each row (`None`: all `KV`).
/// Query `i` of row `b` sits at position `kv_lens[b] − Q + i`; with `options.causal` it sees
/// keys `0..=pos`, otherwise all of the row's keys; a query at a negative position outputs
/// zeros. `out[b, h, i, :]` depends only on that query, the keys and values it sees and the
/// scale: KV-cache decode equals prefill, a row alone equals the row in any batch, chunked
/// prefill equals one call — bitwise. Differentiable under `Autodiff`.
pub fn attention<B: InvariantBackend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    kv_lens: Option<Tensor<B, 1, Int>>,
    options: &AttentionOptions,
) -> Result<Tensor<B, 4>, InvariantError> {
    let scale = validate_inputs(&query, &key, &value, options)?;
    let [batch, _, _, _] = query.dims();
    let kv_len = key.dims()[2];
    let device = query.device();
    let kv_lens = match kv_lens {
        Some(lens) => {
            validate::same_device::<B>("kv_lens", "query", &device, &lens.device())?;
            validate::dim("kv_lens", &lens.dims(), 0, batch, "the batch B of `query`")?;
            validate::lengths_in_range(&lens, "kv_lens", kv_len)?;
            lens
        }
        None => lengths_tensor(&vec![kv_len; batch], &device),
    };
    run(query, key, value, kv_lens, options.causal, scale)
}

/// [`attention`] with the valid keys of each row given on the host, `kv_lens[b] ≤ KV`: the same
/// bits as `attention` with these lengths as a tensor, without its device read of them (a sync
/// per call). For callers that know the lengths, as a KV cache does
/// ([`crate::nn::InvariantAttention::forward_cached`]).
pub fn attention_with_lens<B: InvariantBackend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    kv_lens: &[usize],
    options: &AttentionOptions,
) -> Result<Tensor<B, 4>, InvariantError> {
    let scale = validate_inputs(&query, &key, &value, options)?;
    let [batch, _, _, _] = query.dims();
    let kv_len = key.dims()[2];
    validate::dim(
        "kv_lens",
        &[kv_lens.len()],
        0,
        batch,
        "the batch B of `query`",
    )?;
    validate::host_lengths_in_range(kv_lens.iter().map(|&l| l as i64), "kv_lens", kv_len)?;
    let kv_lens = lengths_tensor(kv_lens, &query.device());
    run(query, key, value, kv_lens, options.causal, scale)
}

/// Every check of the float inputs and options; the scale.
fn validate_inputs<B: InvariantBackend>(
    query: &Tensor<B, 4>,
    key: &Tensor<B, 4>,
    value: &Tensor<B, 4>,
    options: &AttentionOptions,
) -> Result<f32, InvariantError> {
    let [batch, heads, q_len, head_dim] = query.dims();
    let [_, kv_heads, kv_len, _] = key.dims();
    let device = query.device();
    validate::float_dtype("query", query.dtype())?;
    validate::same_dtype("key", "query", query.dtype(), key.dtype())?;
    validate::same_dtype("value", "query", query.dtype(), value.dtype())?;
    validate::same_device::<B>("key", "query", &device, &key.device())?;
    validate::same_device::<B>("value", "query", &device, &value.device())?;
    validate::dim("key", &key.dims(), 0, batch, "the batch B of `query`")?;
    validate::dim("key", &key.dims(), 3, head_dim, "the head size of `query`")?;
    if value.dims() != key.dims() {
        return Err(InvariantError::Shape {
            arg: "value",
            expected: format!("the shape of `key`, {:?}", key.dims()),
            got: value.dims().to_vec(),
        });
    }
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(InvariantError::Shape {
            arg: "key",
            expected: format!(
                "dimension 1 (KV heads) ≥ 1 and dividing the {heads} query heads of `query`"
            ),
            got: key.dims().to_vec(),
        });
    }
    if options.causal && q_len > kv_len {
        return Err(InvariantError::InvalidArgument {
            arg: "query",
            reason: format!(
                "causal attention over {kv_len} keys takes at most {kv_len} queries (queries \
                 are the newest positions), got {q_len}"
            ),
        });
    }
    let scale = options.scale_f32(head_dim)?;
    for (arg, shape) in [
        ("query", query.dims()),
        ("key", key.dims()),
        ("value", value.dims()),
    ] {
        validate::index_limit(arg, &shape)?;
    }
    Ok(scale)
}

/// Lengths already checked, as the primitives' `[B]` tensor.
fn lengths_tensor<B: InvariantBackend>(lens: &[usize], device: &B::Device) -> Tensor<B, 1, Int> {
    let data: Vec<i64> = lens.iter().map(|&l| l as i64).collect();
    Tensor::from_data(TensorData::new(data, [lens.len()]), device)
}

/// The registry's choice and the primitive, on validated inputs.
fn run<B: InvariantBackend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    kv_lens: Tensor<B, 1, Int>,
    causal: bool,
    scale: f32,
) -> Result<Tensor<B, 4>, InvariantError> {
    let [batch, heads, q_len, head_dim] = query.dims();
    let [_, kv_heads, kv_len, _] = key.dims();
    let device = query.device();
    let problem = Problem::Attention {
        batch,
        heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
    };
    let implementation = implementation_for_problem::<B>(&device, query.dtype(), problem)?;
    let inputs = AttentionInputs {
        query: float_primitive(query),
        key: float_primitive(key),
        value: float_primitive(value),
        kv_lens: kv_lens.into_primitive(),
        causal,
        scale,
    };
    let out = B::invariant_attention(inputs, implementation).out;
    check_device::<B>(&device)?;
    Ok(float_tensor(out))
}
