"""`mpsnn check forward-loss` and `mpsnn check loss-gradient` through click's CliRunner: every
loss type and reduction (with and without the batch reduction and a weights image) passes
against the float64 restatement of the loss, the prediction and label gradients against its
autograd and the adjoint test; Kullback-Leibler has no label gradient; planted errors fail;
the loss options are usage errors elsewhere and the geometry options here."""

from __future__ import annotations

import json

import pytest
import torch

import mpsnn.cnn.loss_split as split_module
from mpsnn.cli.families import FAMILIES, make_config
from mpsnn.cli.families_loss import LOSS_TYPES, REDUCTIONS
from tests.cli._helpers import check_report as _report
from tests.cli._helpers import invoke_check as _invoke
from tests.cli._helpers import one_thread  # noqa: F401


def _passes(r: dict, gradients: tuple[str, ...]) -> None:
    assert r["passed"], r["failures"]
    refs = [(c["name"], c["reference"]) for c in r["checks"]]
    expected = [("forward", "mpsnn float64 cpu")]
    expected += [(g, "mpsnn float64 cpu") for g in gradients]
    expected += [("forward", "PyTorch")] + [(g, "PyTorch autograd") for g in gradients]
    assert refs == expected
    assert [a["name"] for a in r["adjoint"]] == list(gradients)
    for a in r["adjoint"]:
        assert a["passed"] and a["lhs"] != 0 and a["tolerance"] == 1e-6
    for c in r["checks"]:
        assert c["relative_error"] <= c["tolerance"]


def test_the_families_are_listed_with_the_loss_options() -> None:
    assert {"forward-loss", "loss-gradient"} <= set(FAMILIES)
    assert list(LOSS_TYPES)[:3] == [
        "mean-absolute-error", "mean-squared-error", "softmax-cross-entropy",
    ]  # fmt: skip
    assert list(REDUCTIONS) == ["none", "sum", "mean", "sum-by-non-zero-weights"]
    cfg = make_config(FAMILIES["loss-gradient"], {"size": (8, 8, 4)})
    assert (cfg.loss, cfg.reduction, cfg.reduce_across_batch, cfg.loss_weights, cfg.weight) == (
        "softmax-cross-entropy", "mean", False, False, 1.0,
    )  # fmt: skip
    help_text = _invoke("--help").stdout
    assert "forward-loss" in help_text and "--reduce-across-batch" in help_text


def test_the_defaults_pass_and_name_what_they_compute() -> None:
    r = _report("loss-gradient")
    _passes(r, ("data gradient", "labels gradient"))
    assert (r["forward_kernel"], r["gradient_kernel"]) == ("ForwardLoss", "LossGradient")
    assert r["source_shape"] == [2, 4, 8, 8] and r["destination_shape"] == [2, 1, 1, 1]
    assert r["torch_equivalent"] == (
        "1.0 * -(w * ((1 - ls) * t + ls / K) * F.log_softmax(x, 1)).sum(1), MEAN per image "
        "(t: labels, w: 1, ls: 0.0, eps: 1e-07)"
    )
    r = _report("forward-loss")
    _passes(r, ())
    assert (r["forward_kernel"], r["gradient_kernel"]) == ("ForwardLoss", None)
    result = _invoke("forward-loss")
    out = " ".join(result.stdout.split())
    assert "(forward only: no gradient kernel)" in out
    assert "PASSED: all 2 checks within tolerance" in out


@pytest.mark.parametrize("loss", list(LOSS_TYPES))
def test_every_loss_type_passes_with_every_reduction(loss) -> None:
    grads = ("data gradient",) if loss == "kullback-leibler-divergence" else (
        "data gradient", "labels gradient",
    )  # fmt: skip
    for i, reduction in enumerate(REDUCTIONS):
        args = ["--loss", loss, "--reduction", reduction, "--size", "3x2x5", "--batch", "3"]
        args += ["--dtype", ("float64", "float32")[i % 2], "--weight", "0.75"]
        r = _report("loss-gradient", *args)
        _passes(r, grads)
        shape = [3, 5, 2, 3] if reduction == "none" else [3, 1, 1, 1]
        if reduction == "none" and loss in (
            "softmax-cross-entropy", "categorical-cross-entropy", "cosine-distance",
        ):  # fmt: skip
            shape[1] = 1  # one loss per pixel
        assert r["destination_shape"] == shape, reduction
        _passes(_report("forward-loss", *args), ())


ACROSS = [
    ("--reduction", "mean", "--reduce-across-batch"),
    ("--reduction", "sum-by-non-zero-weights", "--reduce-across-batch", "--loss-weights"),
    ("--loss", "huber", "--reduction", "sum", "--reduce-across-batch", "--loss-weights"),
    ("--loss", "cosine-distance", "--reduction", "none", "--loss-weights", "--dtype", "float64"),
    ("--loss", "sigmoid-cross-entropy", "--loss-weights", "--dtype", "float16"),
    ("--loss", "log", "--reduction", "sum", "--dtype", "bfloat16", "--batch", "3"),
    ("--loss", "hinge", "--reduction", "mean", "--reduce-across-batch", "--size", "5x1x3"),
]  # fmt: skip


@pytest.mark.parametrize("args", ACROSS, ids=" ".join)
def test_batch_reductions_weights_and_dtypes_pass(args) -> None:
    r = _report("loss-gradient", *args)
    _passes(r, ("data gradient", "labels gradient"))
    if "--reduce-across-batch" in args:
        assert "the batch's value in image 0" in r["torch_equivalent"]
    if "--loss-weights" in args:
        assert "w: weights" in r["torch_equivalent"]


def test_the_batch_reduction_writes_image_zero_only() -> None:
    fam = FAMILIES["loss-gradient"]
    cfg = make_config(fam, {"size": (4, 3, 2), "batch": 3, "reduce_across_batch": True})
    values = fam.inputs(cfg, torch.Generator().manual_seed(0))
    y = fam.run(cfg, values, "cpu", torch.float64).y
    assert y.shape == (3, 1, 1, 1) and y[0].item() != 0 and not y[1:].any()


def test_planted_errors_fail(monkeypatch) -> None:
    original = split_module.forward_loss
    monkeypatch.setattr(split_module, "forward_loss", lambda *a: original(*a) * 1.001)
    result = _invoke("forward-loss", "--json")
    assert result.exit_code == 1
    r = json.loads(result.stdout)
    assert r["failures"] == [r["failures"][0]]
    assert r["failures"][0].startswith("forward vs PyTorch: relative error")
    monkeypatch.undo()

    original_prediction = split_module.prediction_gradient
    monkeypatch.setattr(
        split_module, "prediction_gradient", lambda *a: original_prediction(*a) * 1.001
    )
    r = json.loads(_invoke("loss-gradient", "--loss", "huber", "--json").stdout)
    assert not r["passed"]
    assert any(f.startswith("data gradient vs PyTorch autograd") for f in r["failures"])
    assert any(f.startswith("adjoint test of the data gradient") for f in r["failures"])
    assert not any("labels" in f for f in r["failures"])
    monkeypatch.undo()

    original_label = split_module.label_gradient
    monkeypatch.setattr(split_module, "label_gradient", lambda *a: original_label(*a) + 1e-3)
    r = json.loads(_invoke("loss-gradient", "--reduction", "none", "--json").stdout)
    assert not r["passed"]
    assert any(f.startswith("labels gradient vs PyTorch autograd") for f in r["failures"])
    assert any(f.startswith("adjoint test of the labels gradient") for f in r["failures"])
    assert not any("data gradient" in f for f in r["failures"])


def _usage_error(*args: str) -> str:
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def test_loss_options_are_usage_errors_elsewhere_and_geometry_here() -> None:
    line = _usage_error("convolution", "--loss", "huber")
    assert "--loss does not apply to convolution" in line
    line = _usage_error("loss-gradient", "--offset", "1,0")
    assert "--offset does not apply to loss-gradient" in line
    assert "--loss" in line and "--reduce-across-batch" in line and "--loss-weights" in line
    line = _usage_error("forward-loss", "--loss", "l2")
    assert "'l2' is not one of" in line and "'kullback-leibler-divergence'" in line
    line = _usage_error("loss-gradient", "--reduction", "max")
    assert "'sum-by-non-zero-weights'" in line
