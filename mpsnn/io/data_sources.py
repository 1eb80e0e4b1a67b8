"""Codecs of the objects that hold parameters and their settings: the descriptors
(`OptimizerDescriptor`, `ConvolutionDescriptor`, `NeuronDescriptor`, `LossDescriptor`), the
optimizers (`SGD`, `RMSProp`, `Adam`, with their device tensors) and mpsnn's data sources
(weights or gamma/beta/statistics, the optimizer and its state vectors)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpsnn.cnn.convolution.data_source import TensorConvolutionDataSource
from mpsnn.cnn.convolution.descriptor import ConvolutionDescriptor
from mpsnn.cnn.loss import LossDescriptor, LossType, ReductionType
from mpsnn.cnn.neuron_descriptor import NeuronDescriptor, NeuronType
from mpsnn.cnn.normalization.data_sources import (
    TensorBatchNormalizationDataSource,
    TensorGroupNormalizationDataSource,
    TensorInstanceNormalizationDataSource,
)
from mpsnn.core.kernel import KernelOptions, TrainingStyle
from mpsnn.core.layout import channels_last_only
from mpsnn.io.codec import FLOATS, Encoder, Fields, fail, per_class, register_codec, show
from mpsnn.ops.optim_hyper import RegularizationType, make_step
from mpsnn.optim import SGD, Adam, Optimizer, OptimizerDescriptor, RMSProp

__all__: list[str] = []  # the codecs are registered at import

# ---------------------------------------------------------------------------------------------
# codecs: descriptors


def _enc_optimizer_descriptor(d: OptimizerDescriptor, enc: Encoder) -> dict[str, Any]:
    return {
        "learning_rate": d.learning_rate,
        "gradient_rescale": d.gradient_rescale,
        "apply_gradient_clipping": d.apply_gradient_clipping,
        "gradient_clip_max": d.gradient_clip_max,
        "gradient_clip_min": d.gradient_clip_min,
        "regularization_type": d.regularization_type.name,
        "regularization_scale": d.regularization_scale,
    }


def _dec_optimizer_descriptor(f: Fields) -> OptimizerDescriptor:
    return OptimizerDescriptor(
        learning_rate=f.get_float("learning_rate"),
        gradient_rescale=f.get_float("gradient_rescale"),
        apply_gradient_clipping=f.get_bool("apply_gradient_clipping"),
        gradient_clip_max=f.get_float("gradient_clip_max"),
        gradient_clip_min=f.get_float("gradient_clip_min"),
        regularization_type=f.get_enum("regularization_type", RegularizationType),
        regularization_scale=f.get_float("regularization_scale"),
    )


_CONV_FIELDS = (
    "kernel_width", "kernel_height", "input_feature_channels", "output_feature_channels",
    "stride_in_pixels_x", "stride_in_pixels_y", "dilation_rate_x", "dilation_rate_y", "groups",
)  # fmt: skip


def _enc_convolution_descriptor(d: ConvolutionDescriptor, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(d, name) for name in _CONV_FIELDS}
    out["fused_neuron_descriptor"] = enc.value(d.fused_neuron_descriptor)
    return out


def _dec_convolution_descriptor(f: Fields) -> ConvolutionDescriptor:
    values = [f.get_int(name, 1) for name in _CONV_FIELDS]
    return ConvolutionDescriptor(*values, f.get_value("fused_neuron_descriptor"))


def _enc_neuron_descriptor(d: NeuronDescriptor, enc: Encoder) -> dict[str, Any]:
    return {
        "neuron_type": d.neuron_type.name,
        "a": d.a,
        "b": d.b,
        "c": d.c,
        "data": enc.tensor(d.data, "data"),
    }


def _dec_neuron_descriptor(f: Fields) -> NeuronDescriptor:
    kind = f.get_enum("neuron_type", NeuronType)
    data = f.get_tensor("data", dtypes=(torch.float32,), optional=True)
    if data is not None and data.dim() != 1:
        raise fail(f"{f.who} field 'data' must be 1-D, got shape {list(data.shape)}")
    # PRELU slopes stay a host copy, as NeuronDescriptor keeps them.
    return NeuronDescriptor(kind, f.get_float("a"), f.get_float("b"), f.get_float("c"), data)


def _enc_loss_descriptor(d: LossDescriptor, enc: Encoder) -> dict[str, Any]:
    return {
        "loss_type": d.loss_type.name,
        "reduction_type": d.reduction_type.name,
        "weight": d.weight,
        "label_smoothing": d.label_smoothing,
        "number_of_classes": d.number_of_classes,
        "epsilon": d.epsilon,
        "delta": d.delta,
    }


def _dec_loss_descriptor(f: Fields) -> LossDescriptor:
    return LossDescriptor(
        f.get_enum("loss_type", LossType),
        f.get_enum("reduction_type", ReductionType),
        weight=f.get_float("weight"),
        label_smoothing=f.get_float("label_smoothing"),
        number_of_classes=f.get_int("number_of_classes", 1, optional=True),
        epsilon=f.get_float("epsilon"),
        delta=f.get_float("delta"),
    )


# ---------------------------------------------------------------------------------------------
# codecs: optimizers


def _enc_optimizer(opt: Optimizer, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {
        "label": opt.label,
        "options": int(opt.options),
        "descriptor": enc.object(opt._desc),  # the current options, learning rate included
    }
    if isinstance(opt, SGD):
        out["momentum_scale"] = opt.momentum_scale
        out["use_nesterov_momentum"] = opt.use_nesterov_momentum
    elif isinstance(opt, RMSProp):
        out["decay"], out["epsilon"] = opt.decay, opt.epsilon
    elif isinstance(opt, Adam):
        out["beta1"], out["beta2"], out["epsilon"] = opt.beta1, opt.beta2, opt.epsilon
        out["amsgrad"] = opt._amsgrad
        # the count the client sees (advanced at encode), not the device copy, which lags it
        # while encoded work has not run
        out["step"] = enc.tensor(make_step(opt._step.device, opt.time_step), "step")
    out["hyper"] = enc.tensor(opt._hyper, "hyper")  # the device copy, exactly
    return out


def _dec_optimizer(f: Fields, kind: type) -> Optimizer:
    dev = f.device
    desc = f.get_object("descriptor", OptimizerDescriptor)
    opt: Optimizer
    if kind is SGD:
        opt = SGD(dev, f.get_float("momentum_scale"), f.get_bool("use_nesterov_momentum"), desc)
    elif kind is RMSProp:
        opt = RMSProp(dev, f.get_float("decay"), f.get_float("epsilon"), desc)
    else:
        opt = Adam(
            dev, f.get_float("beta1"), f.get_float("beta2"), f.get_float("epsilon"), 0, desc,
            amsgrad=f.get_bool("amsgrad"),
        )  # fmt: skip
        assert opt._step is not None  # made by Adam
        step = f.get_tensor("step", shape=opt._step.shape, dtypes=(opt._step.dtype,))
        if int(step[0]) < 0:
            raise fail(f"{f.who} field 'step' must hold a time step >= 0, got {int(step[0])}")
        opt._step.copy_(step)
        opt._time_step = int(step[0])
    hyper = f.get_tensor("hyper", shape=opt._hyper.shape, dtypes=(opt._hyper.dtype,))
    opt._hyper.copy_(hyper)
    opt.label = f.get_str("label", optional=True)
    opt.options = KernelOptions(f.get_int("options", 0))
    return opt


# ---------------------------------------------------------------------------------------------
# codecs: data sources


def _enc_optimizer_state(
    ds: Any, enc: Encoder, public: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, list[Any]] | None:
    """``{state name: [one vector per parameter]}`` in the public layout, or None."""
    state = ds._optimizer_state
    if state is None:
        return None
    names = ds._optimizer._state_names()
    if len(names) != len(state):
        raise ValueError(
            f"[save] {type(ds).__name__}'s optimizer state must hold one list per state "
            f"vector of its optimizer {list(names)}, got {len(state)} lists"
        )
    return {
        name: [enc.tensor(public(t), f"{name}{i}") for i, t in enumerate(vectors)]
        for name, vectors in zip(names, state, strict=True)
    }


def _dec_optimizer_state(
    f: Fields,
    optimizer: Any,
    params: Sequence[torch.Tensor | None],
    internal: Callable[[torch.Tensor], torch.Tensor],
) -> list[list[torch.Tensor]] | None:
    """The optimizer state vectors, checked against ``params`` (public layout) and converted
    to the internal layout."""
    raw = f.raw("optimizer_state")
    if raw is None:
        return None
    if optimizer is None:
        raise fail(f"{f.who} field 'optimizer_state' must be null without an optimizer, got one")
    names = list(optimizer._state_names())
    if type(raw) is not dict or sorted(raw) != sorted(names):
        raise fail(
            f"{f.who} field 'optimizer_state' must map the optimizer's state vectors {names} "
            f"to lists, got {show(raw)}"
        )
    present = [p for p in params if p is not None]
    out = []
    for name in names:
        refs = raw[name]
        if type(refs) is not list or not 1 <= len(refs) <= len(present):
            raise fail(
                f"{f.who} field 'optimizer_state' must hold 1 to {len(present)} vectors for "
                f"{name!r} (one per parameter), got {show(refs)}"
            )
        vectors = []
        for i, ref in enumerate(refs):
            p = present[i]
            t = f.resolve_tensor(
                ref, f"'optimizer_state.{name}.{i}'", shape=p.shape, dtypes=(p.dtype,)
            )
            vectors.append(internal(t))
        out.append(vectors)
    if len({len(v) for v in out}) > 1:
        raise fail(f"{f.who} field 'optimizer_state' must hold as many vectors for every name")
    return out


def _to_ohwi(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 2, 3, 1) if t.dim() == 4 else t


def _to_oihw(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 3, 1, 2).contiguous() if t.dim() == 4 else t.clone()


def _to_channels_last_oihw(t: torch.Tensor) -> torch.Tensor:
    """An OHWI tensor as OIHW over OHWI memory (channels-last), a copy."""
    return (
        t.clone(memory_format=torch.contiguous_format).permute(0, 3, 1, 2)
        if t.dim() == 4
        else t.clone()
    )


def _enc_training_style(ds: Any) -> str:
    return TrainingStyle(ds.training_style).name


def _dec_training_style(f: Fields, ds: Any) -> None:
    style = f.get_enum("training_style", TrainingStyle)
    if style is not type(ds).training_style:
        ds.training_style = style


def _enc_conv_data_source(ds: TensorConvolutionDataSource, enc: Encoder) -> dict[str, Any]:
    out = {
        "label": ds.label,
        "training_style": _enc_training_style(ds),
        "descriptor": enc.object(ds.descriptor()),
        "weights": enc.tensor(ds.weights(), "weights"),  # OHWI
        "biases": enc.tensor(ds.bias_terms(), "biases"),
        "optimizer": enc.object(ds.optimizer),
        "optimizer_state": _enc_optimizer_state(ds, enc, _to_ohwi),
    }
    if channels_last_only(ds._state._oihw):
        # held in OHWI memory (channels-last OIHW, a CPU float32 convolution's): a load
        # restores that order, the optimizer state's too, so that updates take the same path
        # and continue bit for bit (without the field: OIHW memory)
        out["weights_memory"] = "ohwi"
    return out


def _dec_conv_data_source(f: Fields) -> TensorConvolutionDataSource:
    desc = f.get_object("descriptor", ConvolutionDescriptor)
    w = f.get_tensor("weights", shape=desc.weights_shape, dtypes=FLOATS)
    b = f.get_tensor(
        "biases", shape=(desc.output_feature_channels,), dtypes=(w.dtype,), optional=True
    )
    opt = f.get_object("optimizer", Optimizer, optional=True)
    memory = f.get_str("weights_memory") if f.has("weights_memory") else "oihw"
    if memory not in ("oihw", "ohwi"):
        raise fail(f"{f.who} field 'weights_memory' must be 'oihw' or 'ohwi', got {show(memory)}")
    # the data source wraps what it is given, in the memory order it was saved with: an OHWI
    # view of OIHW memory keeps the GPU optimizer's one-launch path (its gradient sums are
    # OIHW); OHWI memory (channels-last OIHW) is what a CPU float32 convolution runs on
    ohwi = memory == "ohwi" and w.dim() == 4
    w = w.contiguous() if ohwi else w.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)
    ds = TensorConvolutionDataSource(desc, w, b, opt, f.get_str("label", optional=True))
    ds._descriptor = desc  # the loaded object itself (the constructor keeps a copy)
    _dec_training_style(f, ds)
    internal = _to_channels_last_oihw if ohwi else _to_oihw
    ds._optimizer_state = _dec_optimizer_state(f, opt, [ds.weights(), ds.bias_terms()], internal)
    return ds


def _enc_norm_data_source(ds: Any, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {
        "label": ds.label,
        "training_style": _enc_training_style(ds),
        "number_of_feature_channels": ds.number_of_feature_channels,
    }
    if isinstance(ds, TensorGroupNormalizationDataSource):
        out["number_of_groups"] = ds.number_of_groups
    out["epsilon"] = ds.epsilon
    out["gamma"] = enc.tensor(ds.gamma(), "gamma")
    out["beta"] = enc.tensor(ds.beta(), "beta")
    if isinstance(ds, TensorBatchNormalizationDataSource):
        out["momentum"] = ds.momentum
        out["mean"] = enc.tensor(ds.mean(), "mean")
        out["variance"] = enc.tensor(ds.variance(), "variance")
    out["optimizer"] = enc.object(ds.optimizer)
    out["optimizer_state"] = _enc_optimizer_state(ds, enc, lambda t: t)
    return out


def _dec_norm_data_source(f: Fields, kind: type) -> Any:
    c = f.get_int("number_of_feature_channels", 1)
    gamma = f.get_tensor("gamma", shape=(c,), dtypes=FLOATS)
    same = {"shape": (c,), "dtypes": (gamma.dtype,)}  # the constructor would convert others
    beta = f.get_tensor("beta", **same)
    eps = f.get_float("epsilon")
    opt = f.get_object("optimizer", Optimizer, optional=True)
    label = f.get_str("label", optional=True)
    if kind is TensorBatchNormalizationDataSource:
        mean, var = f.get_tensor("mean", **same), f.get_tensor("variance", **same)
        ds = kind(c, gamma, beta, mean, var, eps, f.get_float("momentum"), opt, label)
    elif kind is TensorGroupNormalizationDataSource:
        ds = kind(c, f.get_int("number_of_groups", 1), gamma, beta, eps, opt, label)
    else:
        ds = kind(c, gamma, beta, eps, opt, label)
    _dec_training_style(f, ds)
    ds._optimizer_state = _dec_optimizer_state(f, opt, [ds.gamma(), ds.beta()], torch.clone)
    return ds


for _cls, _encode, _decode in (
    (OptimizerDescriptor, _enc_optimizer_descriptor, _dec_optimizer_descriptor),
    (ConvolutionDescriptor, _enc_convolution_descriptor, _dec_convolution_descriptor),
    (NeuronDescriptor, _enc_neuron_descriptor, _dec_neuron_descriptor),
    (LossDescriptor, _enc_loss_descriptor, _dec_loss_descriptor),
    (SGD, _enc_optimizer, per_class(_dec_optimizer, SGD)),
    (RMSProp, _enc_optimizer, per_class(_dec_optimizer, RMSProp)),
    (Adam, _enc_optimizer, per_class(_dec_optimizer, Adam)),
    (TensorConvolutionDataSource, _enc_conv_data_source, _dec_conv_data_source),
    (
        TensorBatchNormalizationDataSource,
        _enc_norm_data_source,
        per_class(_dec_norm_data_source, TensorBatchNormalizationDataSource),
    ),
    (
        TensorInstanceNormalizationDataSource,
        _enc_norm_data_source,
        per_class(_dec_norm_data_source, TensorInstanceNormalizationDataSource),
    ),
    (
        TensorGroupNormalizationDataSource,
        _enc_norm_data_source,
        per_class(_dec_norm_data_source, TensorGroupNormalizationDataSource),
    ),
):
    register_codec(_cls, _encode, _decode)
del _cls, _encode, _decode
