//! `Reference` attention on NdArray: the oracle's arithmetic on host copies.
use burn::tensor::ops::FloatTensor;
use burn_ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray,
};

use super::oracle::{self, AttentionSaved, AttentionShape};
use super::{AttentionGrads, AttentionInputs, AttentionOps, AttentionOutput};
use crate::backends::ndarray::{HostFloat, device_tensor, host_float, host_int};
use crate::registry::Implementation;

fn shape_of(
    inputs: &AttentionInputs<impl burn::tensor::backend::Backend>,
    q: &HostFloat,
    k: &HostFloat,
) -> AttentionShape {
    AttentionShape {
        batch: q.shape[0],
        heads: q.shape[1],
        kv_heads: k.shape[1],
        q_len: q.shape[2],
        kv_len: k.shape[2],
        head_dim: q.shape[3],
        causal: inputs.causal,
        scale: inputs.scale,
    }
}

/// `kv_lens` as host lengths (validated to `[0, KV]` by the public function).
fn lengths(kv_lens: &NdArrayTensor) -> Vec<usize> {
    host_int(kv_lens)
        .into_iter()
        .map(|l| l.max(0) as usize)
        .collect()
}

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> AttentionOps
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
    fn invariant_attention(
        inputs: AttentionInputs<Self>,
        _implementation: Implementation,
    ) -> AttentionOutput<Self> {
        let (q, k, v) = (
            host_float(&inputs.query),
            host_float(&inputs.key),
            host_float(&inputs.value),
        );
        let shape = shape_of(&inputs, &q, &k);
        let (out, lse) =
            oracle::attention_forward(&shape, &q.data, &k.data, &v.data, &lengths(&inputs.kv_lens));
        AttentionOutput {
            out: device_tensor(out, q.shape.clone(), q.dtype),
            lse: device_tensor(lse, q.shape[..3].to_vec(), burn::tensor::DType::F32),
        }
    }

    fn invariant_attention_backward(
        inputs: AttentionInputs<Self>,
        saved: AttentionOutput<Self>,
        grad: FloatTensor<Self>,
        _implementation: Implementation,
    ) -> AttentionGrads<Self> {
        let (q, k, v) = (
            host_float(&inputs.query),
            host_float(&inputs.key),
            host_float(&inputs.value),
        );
        let shape = shape_of(&inputs, &q, &k);
        let (out, lse, grad) = (
            host_float(&saved.out),
            host_float(&saved.lse),
            host_float(&grad),
        );
        let saved = AttentionSaved {
            out: &out.data,
            lse: &lse.data,
            grad: &grad.data,
        };
        let (dq, dk, dv) = oracle::attention_backward(
            &shape,
            &q.data,
            &k.data,
            &v.data,
            &lengths(&inputs.kv_lens),
            saved,
        );
        AttentionGrads {
            query: device_tensor(dq, q.shape, q.dtype),
            key: device_tensor(dk, k.shape, k.dtype),
            value: device_tensor(dv, v.shape, v.dtype),
        }
    }
}
