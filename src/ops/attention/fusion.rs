//! Attention under `Fusion`: opaque custom ops over the inner backend's primitives.
use burn::tensor::{DType, ops::FloatTensor};
use burn_fusion::{Fusion, FusionBackend};

use super::{AttentionGrads, AttentionInputs, AttentionOps, AttentionOutput};
use crate::backends::custom_op::custom_op;
use crate::registry::Implementation;

impl<B: FusionBackend + AttentionOps> AttentionOps for Fusion<B> {
    fn invariant_attention(
        inputs: AttentionInputs<Self>,
        implementation: Implementation,
    ) -> AttentionOutput<Self> {
        let AttentionInputs {
            query,
            key,
            value,
            kv_lens,
            causal,
            scale,
        } = inputs;
        let lse_shape = query.shape.to_vec()[..3].to_vec();
        let outputs = [
            (query.shape.clone(), query.dtype),
            (lse_shape.into(), DType::F32),
        ];
        let [out, lse] = custom_op::<B, 3, 1, 2>(
            "burn_invariant::attention",
            [query, key, value],
            [kv_lens],
            outputs,
            Box::new(move |[query, key, value], [kv_lens]| {
                let inputs = AttentionInputs {
                    query,
                    key,
                    value,
                    kv_lens,
                    causal,
                    scale,
                };
                let out = B::invariant_attention(inputs, implementation);
                [out.out, out.lse]
            }),
        );
        AttentionOutput { out, lse }
    }

    fn invariant_attention_backward(
        inputs: AttentionInputs<Self>,
        saved: AttentionOutput<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> AttentionGrads<Self> {
        let AttentionInputs {
            query,
            key,
            value,
            kv_lens,
            causal,
            scale,
        } = inputs;
        let outputs = [
            (query.shape.clone(), query.dtype),
            (key.shape.clone(), key.dtype),
            (value.shape.clone(), value.dtype),
        ];
        let [query, key, value] = custom_op::<B, 6, 1, 3>(
            "burn_invariant::attention_backward",
            [query, key, value, saved.out, saved.lse, grad],
            [kv_lens],
            outputs,
            Box::new(move |[query, key, value, out, lse, grad], [kv_lens]| {
                let inputs = AttentionInputs {
                    query,
                    key,
                    value,
                    kv_lens,
                    causal,
                    scale,
                };
                let saved = AttentionOutput { out, lse };
                let grads = B::invariant_attention_backward(inputs, saved, grad, implementation);
                [grads.query, grads.key, grads.value]
            }),
        );
        AttentionGrads { query, key, value }
    }
}
