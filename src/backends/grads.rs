//! The one step every op's `Autodiff` backward shares: registering the computed gradients of
//! the tracked parents.
use burn::tensor::{backend::Backend, ops::FloatTensor};
use burn_autodiff::{NodeId, grads::Gradients};

/// Registers the computed gradients of the parents that are tracked.
pub(crate) fn register_grads<B: Backend>(
    grads: &mut Gradients,
    parents: impl IntoIterator<Item = Option<NodeId>>,
    computed: impl IntoIterator<Item = Option<FloatTensor<B>>>,
) {
    for (node, grad) in parents.into_iter().zip(computed) {
        if let (Some(node), Some(grad)) = (node, grad) {
            grads.register::<B>(node, grad);
        }
    }
}
