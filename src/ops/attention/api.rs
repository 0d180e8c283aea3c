//! The public `attention`: validation, the registry's choice, the primitive.
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
    let kv_lens = match kv_lens {
        Some(lens) => {
            validate::same_device::<B>("kv_lens", "query", &device, &lens.device())?;
            validate::dim("kv_lens", &lens.dims(), 0, batch, "the batch B of `query`")?;
            validate::lengths_in_range(&lens, "kv_lens", kv_len)?;
            lens
        }
        None => Tensor::from_data(
            TensorData::new(vec![kv_len as i64; batch], [batch]),
            &device,
        ),
    };
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
        causal: options.causal,
        scale,
    };
    let out = B::invariant_attention(inputs, implementation).out;
    check_device::<B>(&device)?;
    Ok(float_tensor(out))
}
