//! The modules the README calls drop-ins: a record saved from ours loads into Burn's module and
//! back (and one of Burn's into ours), bitwise, through a named MessagePack recorder as a user
//! would save a checkpoint. Parameters are set explicitly: a lazily initialized `Param` and its
//! clone would each draw their own values. Scalars such as `epsilon` are configuration, not
//! record (in Burn's modules and ours alike): they come from the config the module was built from.
use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig, RmsNorm, RmsNormConfig};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use burn::tensor::{Distribution, Tensor};
use burn_invariant::nn::{
    InvariantLinear, InvariantLinearConfig, InvariantRmsNorm, InvariantRmsNormConfig,
};

type B = burn::backend::NdArray<f32>;

/// `from`'s record saved to bytes and loaded into `into`.
fn reload<M1: Module<B>, M2: Module<B>>(from: M1, into: M2) -> M2 {
    let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = Recorder::<B>::record(&recorder, from.into_record(), ()).expect("save");
    let record = Recorder::<B>::load(&recorder, bytes, &Default::default()).expect("load");
    into.load_record(record)
}

fn bits<const D: usize>(t: &Param<Tensor<B, D>>) -> Vec<u32> {
    t.val()
        .into_data()
        .to_vec::<f32>()
        .expect("f32")
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn random<const D: usize>(shape: [usize; D]) -> Param<Tensor<B, D>> {
    Param::from_tensor(Tensor::random(
        shape,
        Distribution::Uniform(-1.0, 1.0),
        &Default::default(),
    ))
}

#[test]
fn rms_norm_records_load_into_burn_and_back() {
    let device = Default::default();
    let mut ours = InvariantRmsNormConfig::new(37)
        .with_epsilon(1e-6)
        .init::<B>(&device)
        .expect("valid");
    ours.gamma = random([37]);
    let burns: RmsNorm<B> = reload(
        ours.clone(),
        RmsNormConfig::new(37).with_epsilon(1e-6).init(&device),
    );
    assert_eq!(bits(&burns.gamma), bits(&ours.gamma));
    assert_eq!(burns.epsilon, ours.epsilon);
    let back: InvariantRmsNorm<B> = reload(
        burns.clone(),
        InvariantRmsNormConfig::new(37)
            .with_epsilon(1e-6)
            .init(&device)
            .expect("valid"),
    );
    assert_eq!(bits(&back.gamma), bits(&ours.gamma));
    assert_eq!(back.epsilon, 1e-6);
    // Same layer: both compute RMSNorm of the same input within rounding.
    let x = Tensor::<B, 2>::random([5, 37], Distribution::Uniform(-2.0, 2.0), &device);
    let diff = (back.forward(x.clone()).expect("rms_norm") - burns.forward(x))
        .abs()
        .max()
        .into_scalar();
    assert!(diff < 1e-5, "max |ours - Burn's| = {diff}");
}

#[test]
fn linear_records_load_into_burn_and_back() {
    let device = Default::default();
    for bias in [true, false] {
        let mut ours = InvariantLinearConfig::new(19, 7)
            .with_bias(bias)
            .init::<B>(&device);
        ours.weight = random([19, 7]);
        ours.bias = bias.then(|| random([7]));
        let burns: Linear<B> = reload(
            ours.clone(),
            LinearConfig::new(19, 7).with_bias(bias).init(&device),
        );
        assert_eq!(bits(&burns.weight), bits(&ours.weight));
        assert_eq!(
            burns.bias.as_ref().map(bits),
            ours.bias.as_ref().map(bits),
            "bias {bias}"
        );
        let back: InvariantLinear<B> = reload(
            burns.clone(),
            InvariantLinearConfig::new(19, 7)
                .with_bias(bias)
                .init(&device),
        );
        assert_eq!(bits(&back.weight), bits(&ours.weight));
        assert_eq!(back.bias.as_ref().map(bits), ours.bias.as_ref().map(bits));
        let x = Tensor::<B, 2>::random([4, 19], Distribution::Uniform(-2.0, 2.0), &device);
        let diff = (back.forward(x.clone()).expect("linear") - burns.forward(x))
            .abs()
            .max()
            .into_scalar();
        assert!(diff < 1e-5, "max |ours - Burn's| = {diff}");
    }
}
