//! Attention on every `CubeBackend`: the kernels of `burn_invariant_cubecl::attention`, and on
//! CUDA the raw Sm90 ones (`crate::backends::sm90`); outputs and workspace allocated on the
//! inputs' stream.
use burn::tensor::{
    DType, IntDType,
    ops::{FloatTensor, IntTensorOps},
};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor,
};
use burn_invariant_cubecl::FloatDType;
use burn_invariant_cubecl::attention::{self as kernels, AttentionGradRefs, AttentionRefs};

use super::oracle::{ATTENTION_KEY_BLOCK, ATTENTION_KEY_SPLIT};
use super::{AttentionGrads, AttentionInputs, AttentionOps, AttentionOutput};
use crate::backends::alloc::{empty, zeros};
use crate::backends::cube::{addressable, launch_class, launched, settle_launches};
use crate::registry::Implementation;

// The Reference walks keys in the kernels' blocks and splits: checked at compile time.
const _: () = assert!(ATTENTION_KEY_BLOCK == kernels::ATTENTION_KEY_BLOCK);
const _: () = assert!(ATTENTION_KEY_SPLIT == kernels::ATTENTION_KEY_SPLIT);

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> AttentionOps
    for CubeBackend<R, F, I, BT>
{
    fn invariant_attention(
        inputs: AttentionInputs<Self>,
        implementation: Implementation,
    ) -> AttentionOutput<Self> {
        #[cfg(feature = "cuda")]
        if implementation == Implementation::Sm90 {
            let kv_lens = Self::int_cast(inputs.kv_lens, IntDType::I32);
            let (out, lse) = crate::backends::sm90::attention(
                [inputs.query, inputs.key, inputs.value],
                kv_lens,
                inputs.causal,
                inputs.scale,
            );
            return AttentionOutput { out, lse };
        }
        // Reference is not offered here, nor Sm90 without the `cuda` feature: a direct call
        // with either runs the CubeCL kernels.
        let _ = implementation;
        let q_shape = inputs.query.meta.shape().to_vec();
        let out = empty(&inputs.query, q_shape.clone(), inputs.query.dtype);
        let lse = empty(&inputs.query, q_shape[..3].to_vec(), DType::F32);
        let (query, key, value) = (
            addressable(inputs.query),
            addressable(inputs.key),
            addressable(inputs.value),
        );
        let kv_lens = Self::int_cast(inputs.kv_lens, IntDType::I32);
        let class = attention_class("attention", inputs.causal, [&query, &key, &value]);
        let refs = AttentionRefs {
            query: &query.clone().binding(),
            key: &key.binding(),
            value: &value.binding(),
            kv_lens: &kv_lens.binding(),
            dtype: launched(FloatDType::from_storage("query", query.dtype.into())),
            causal: inputs.causal,
            scale: inputs.scale,
        };
        launched(kernels::attention_forward(
            &query.client,
            &refs,
            &out.clone().binding(),
            &lse.clone().binding(),
        ));
        settle_launches(&query.client, &query.device, class);
        AttentionOutput { out, lse }
    }

    fn invariant_attention_backward(
        inputs: AttentionInputs<Self>,
        saved: AttentionOutput<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> AttentionGrads<Self> {
        #[cfg(feature = "cuda")]
        if implementation == Implementation::Sm90 {
            let kv_lens = Self::int_cast(inputs.kv_lens, IntDType::I32);
            let [query, key, value] = crate::backends::sm90::attention_backward(
                [inputs.query, inputs.key, inputs.value],
                kv_lens,
                [saved.out, saved.lse, grad],
                inputs.causal,
                inputs.scale,
            );
            return AttentionGrads { query, key, value };
        }
        let _ = implementation;
        let q_shape = inputs.query.meta.shape().to_vec();
        let kv_shape = inputs.key.meta.shape().to_vec();
        let dtype = inputs.query.dtype;
        let grad_query = empty(&inputs.query, q_shape.clone(), dtype);
        if q_shape[..3].contains(&0) {
            // No query: no kernel runs, and no key or value gets a gradient.
            return AttentionGrads {
                query: grad_query,
                key: zeros(&inputs.query, kv_shape.clone(), dtype),
                value: zeros(&inputs.query, kv_shape, dtype),
            };
        }
        let grad_key = empty(&inputs.query, kv_shape.clone(), dtype);
        let grad_value = empty(&inputs.query, kv_shape, dtype);
        let workspace_len =
            kernels::attention_backward_workspace_len(q_shape[0], q_shape[1], q_shape[2]);
        let workspace = empty(&inputs.query, vec![workspace_len], DType::F32);
        let (query, key, value) = (
            addressable(inputs.query),
            addressable(inputs.key),
            addressable(inputs.value),
        );
        let kv_lens = Self::int_cast(inputs.kv_lens, IntDType::I32);
        let class = attention_class("attention_backward", inputs.causal, [&query, &key, &value]);
        let refs = AttentionRefs {
            query: &query.clone().binding(),
            key: &key.binding(),
            value: &value.binding(),
            kv_lens: &kv_lens.binding(),
            dtype: launched(FloatDType::from_storage("query", query.dtype.into())),
            causal: inputs.causal,
            scale: inputs.scale,
        };
        let grads = AttentionGradRefs {
            out: &addressable(saved.out).binding(),
            lse: &saved.lse.binding(),
            grad_out: &addressable(grad).binding(),
            grad_query: &grad_query.clone().binding(),
            grad_key: &grad_key.clone().binding(),
            grad_value: &grad_value.clone().binding(),
            workspace: &workspace.binding(),
        };
        launched(kernels::attention_backward(&query.client, &refs, &grads));
        settle_launches(&query.client, &query.device, class);
        AttentionGrads {
            query: grad_query,
            key: grad_key,
            value: grad_value,
        }
    }
}

/// The launch class of an attention call: batch rows and key counts vary freely between calls
/// of one model; the heads, query rows and head size pick the kernels.
fn attention_class<R: CubeRuntime>(
    primitive: &'static str,
    causal: bool,
    [query, key, value]: [&CubeTensor<R>; 3],
) -> u64 {
    launch_class(
        (primitive, causal),
        &[(query, &[0][..]), (key, &[0, 2]), (value, &[0, 2])],
    )
}
