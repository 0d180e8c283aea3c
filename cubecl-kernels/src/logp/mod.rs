//! Fused linear log-probability (`linear_logp`): forward and backward without any `[N, V]`
//! buffer.

mod backward;
mod forward;
mod inputs;
mod logits;

pub use backward::linear_logp_backward;
pub use forward::linear_logp_forward;
pub use inputs::{
    LogpGradRefs, LogpInputRefs, linear_logp_backward_workspace_len,
    linear_logp_forward_workspace_len, linear_logp_num_segments,
};
