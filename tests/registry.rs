//! The registry: default choice, the `BURN_INVARIANT_IMPL` override, and refusals.
use burn::tensor::{DType, Tensor};
use burn_invariant::{
    InvariantError,
    registry::{Implementation, OVERRIDE_ENV, Op, implementation_for},
};
use serial_test::serial;

type B = burn::backend::NdArray<f32>;
type AD = burn::backend::Autodiff<B>;

/// Sets the override for the scope of one test.
struct Override;

impl Override {
    fn set(value: &str) -> Self {
        // SAFETY: every test that touches the environment is #[serial].
        unsafe { std::env::set_var(OVERRIDE_ENV, value) };
        Override
    }
}

impl Drop for Override {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { std::env::remove_var(OVERRIDE_ENV) };
    }
}

#[test]
#[serial]
fn ndarray_runs_the_reference() {
    let device = Default::default();
    for op in [Op::Matmul, Op::LinearLogp] {
        for dtype in [DType::F32, DType::F64] {
            assert_eq!(
                implementation_for::<B>(op, &device, dtype),
                Ok(Implementation::Reference)
            );
            assert_eq!(
                implementation_for::<AD>(op, &device, dtype),
                Ok(Implementation::Reference)
            );
        }
        let err = implementation_for::<B>(op, &device, DType::BF16).unwrap_err();
        assert!(
            matches!(
                err,
                InvariantError::NoImplementation {
                    dtype: DType::BF16,
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[test]
#[serial]
fn override_selects_or_refuses() {
    let device = Default::default();
    {
        let _guard = Override::set("reference");
        assert_eq!(
            implementation_for::<B>(Op::Matmul, &device, DType::F32),
            Ok(Implementation::Reference)
        );
    }
    for (value, forced) in [
        ("cubecl", Implementation::CubeCl),
        ("SM90", Implementation::Sm90),
    ] {
        let _guard = Override::set(value);
        let err = implementation_for::<B>(Op::LinearLogp, &device, DType::F32).unwrap_err();
        assert!(
            matches!(err, InvariantError::ImplementationUnavailable { implementation, op: Op::LinearLogp, .. } if implementation == forced),
            "{err}"
        );
        // The public API returns the same error instead of falling back.
        let x = Tensor::<B, 2>::ones([2, 3], &device);
        let err = burn_invariant::matmul(x.clone(), x.transpose()).unwrap_err();
        assert!(
            matches!(err, InvariantError::ImplementationUnavailable { .. }),
            "{err}"
        );
    }
    {
        let _guard = Override::set("fastest");
        let err = implementation_for::<B>(Op::Matmul, &device, DType::F32).unwrap_err();
        assert_eq!(
            err,
            InvariantError::InvalidOverride {
                got: "fastest".into()
            }
        );
    }
    {
        let _guard = Override::set("  ");
        assert_eq!(
            implementation_for::<B>(Op::Matmul, &device, DType::F32),
            Ok(Implementation::Reference)
        );
    }
}

/// The fingerprint: stable, the same for a backend and its `Autodiff` (a rollout without
/// gradients and its trainer), printable with its digest; and it changes when another
/// implementation is forced.
#[test]
#[serial]
fn fingerprint_follows_the_implementation() {
    let device = Default::default();
    let plain = burn_invariant::fingerprint::<B>(&device);
    assert_eq!(plain, burn_invariant::fingerprint::<B>(&device));
    assert_eq!(plain, burn_invariant::fingerprint::<AD>(&device));
    let digest = plain.digest();
    assert_eq!(digest.len(), 16);
    let text = plain.to_string();
    assert!(
        text.starts_with(&format!("burn-invariant fingerprint {digest}")),
        "{text}"
    );
    assert!(text.contains(env!("CARGO_PKG_VERSION")), "{text}");
    assert!(text.contains("Matmul Reference"), "{text}");
    let forced = {
        let _override = Override::set("cubecl");
        burn_invariant::fingerprint::<B>(&device)
    };
    assert_ne!(forced, plain);
    assert_ne!(forced.digest(), digest);
    assert_eq!(plain, burn_invariant::fingerprint::<B>(&device));
}
