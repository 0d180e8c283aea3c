//! The implementations of [`crate::InvariantBackend`], one file per Burn backend type:
//! `Reference` on NdArray, `CubeCl` (and `Sm90` on CUDA) on every `CubeBackend`, `Fusion` and
//! `Autodiff` as wrappers that call the inner backend's primitives. Nothing here imports
//! `crate::tp`: the tensor-parallel engine sits on top of these primitives.
#[cfg(feature = "cubecl")]
pub(crate) mod alloc;
pub(crate) mod autodiff;
#[cfg(feature = "cubecl")]
pub(crate) mod cube;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(feature = "cubecl")]
pub(crate) mod custom_op;
#[cfg(feature = "cubecl")]
mod fusion;
pub(crate) mod generic;
pub(crate) mod grads;
pub(crate) mod ndarray;
#[cfg(feature = "cuda")]
pub(crate) mod sm90;
