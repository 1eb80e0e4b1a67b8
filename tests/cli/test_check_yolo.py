"""`mpsnn check yolo-loss` through click's CliRunner: anchors, classes, grid sizes, rescore on
and off, every reduction, a weights image and the dtypes pass against the float64 restatement
(the loss) and its autograd (the gradient), with the adjoint test where the gradient is the
forward's derivative (rescore off); planted errors in the loss and in the gradient fail; usage
errors are one line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import mpsnn.cnn.yolo as yolo_module
from mpsnn.cli import main
from mpsnn.cli.families import FAMILIES, make_config
from tests.cli._helpers import check_report, invoke_check, one_thread  # noqa: F401


def _invoke(*args: str):
    return invoke_check("yolo-loss", *args)


def _report(*args: str) -> dict:
    return check_report("yolo-loss", *args)


def _passes(r: dict, adjoint: bool) -> None:
    assert r["passed"], r["failures"]
    assert [(c["name"], c["reference"]) for c in r["checks"]] == [
        ("forward", "mpsnn float64 cpu"), ("data gradient", "mpsnn float64 cpu"),
        ("forward", "PyTorch"), ("data gradient", "PyTorch autograd"),
    ]  # fmt: skip
    for c in r["checks"]:
        assert c["relative_error"] <= c["tolerance"]
    if adjoint:
        (a,) = r["adjoint"]
        assert a["passed"] and a["lhs"] != 0 and a["tolerance"] == 1e-6
        assert r["adjoint_note"] is None
    else:
        assert r["adjoint"] == [] and r["adjoint_note"].startswith("rescore: the gradient holds")


def test_the_defaults_pass_and_say_why_rescore_has_no_adjoint_test() -> None:
    cfg = make_config(FAMILIES["yolo-loss"], {"size": (8, 8, 4)})
    assert (cfg.anchors, cfg.classes, cfg.rescore, cfg.reduction) == (
        ((1.0, 2.0), (1.0, 1.0), (2.0, 1.0)), 2, True, "mean",
    )  # fmt: skip
    r = _report()
    _passes(r, adjoint=False)
    assert (r["forward_kernel"], r["gradient_kernel"]) == ("YOLOLoss", "YOLOLoss (its destination)")
    assert r["source_shape"] == [2, 21, 8, 8] and r["destination_shape"] == [2, 1, 1, 1]
    assert (
        "MEAN per image (anchors [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)], w: 1)"
        in (r["torch_equivalent"])
    )
    out = " ".join(_invoke().stdout.split())
    assert "adjoint test in float64 on the cpu: none (rescore: the gradient holds" in out
    assert "PASSED: all 4 checks within tolerance" in out


GEOMETRIES = [
    ("--no-rescore",),
    ("--no-rescore", "--reduction", "none", "--dtype", "float64", "--batch", "3"),
    ("--no-rescore", "--reduction", "sum", "--anchors", "1x1", "--classes", "1"),
    ("--no-rescore", "--reduction", "sum-by-non-zero-weights", "--loss-weights",
     "--anchors", "1x1,2.5x1.5", "--classes", "3", "--size", "5x4x16"),
    ("--reduction", "none", "--loss-weights", "--size", "3x6x21"),
    ("--reduction", "sum", "--dtype", "float16", "--anchors", "0.5x0.75,3x2", "--classes", "4"),
    ("--no-rescore", "--dtype", "bfloat16", "--size", "7x2x21", "--seed", "5"),
]  # fmt: skip


@pytest.mark.parametrize("args", GEOMETRIES, ids=" ".join)
def test_anchors_classes_reductions_weights_and_dtypes_pass(args) -> None:
    r = _report(*args)
    _passes(r, adjoint="--no-rescore" in args)
    n = 3 if "--batch" in args else 2
    channels = r["source_shape"][1]
    if "--reduction" in args and args[args.index("--reduction") + 1] == "none":
        assert r["destination_shape"] == [n, channels, *r["source_shape"][2:]]
    else:
        assert r["destination_shape"] == [n, 1, 1, 1]
    if "--loss-weights" in args:
        assert "w: weights" in r["torch_equivalent"]


def test_planted_errors_fail(monkeypatch) -> None:
    original = yolo_module.yolo_loss_forward_backward

    def wrong_loss(*args):
        loss, grad = original(*args)
        return loss * 1.001, grad

    monkeypatch.setattr(yolo_module, "yolo_loss_forward_backward", wrong_loss)
    result = _invoke("--no-rescore", "--json")
    assert result.exit_code == 1
    r = json.loads(result.stdout)
    assert r["failures"][0].startswith("forward vs PyTorch: relative error")
    assert not any("data gradient vs" in f for f in r["failures"])
    assert any(f.startswith("adjoint test of the data gradient") for f in r["failures"])
    monkeypatch.undo()

    def wrong_gradient(*args):
        loss, grad = original(*args)
        grad = grad.clone()
        grad[:, 4] *= 1.01  # the confidence of the first anchor
        return loss, grad

    monkeypatch.setattr(yolo_module, "yolo_loss_forward_backward", wrong_gradient)
    for args in (("--no-rescore",), ("--reduction", "none")):
        result = _invoke(*args, "--json")
        assert result.exit_code == 1
        r = json.loads(result.stdout)
        assert any(f.startswith("data gradient vs PyTorch autograd") for f in r["failures"])
        assert not any(f.startswith("forward vs") for f in r["failures"])
        if "--no-rescore" in args:
            assert any(f.startswith("adjoint test of the data gradient") for f in r["failures"])


def _usage_error(*args: str, family: str = "yolo-loss") -> str:
    result = CliRunner().invoke(main, ["check", family, *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def test_usage_errors_are_one_line() -> None:
    line = _usage_error("--size", "8x8x4")
    assert "--size must have the predictions' 3·(5 + 2) = 21 channels (--anchors, --classes) " in (
        line
    )
    assert line.endswith("for yolo-loss, got 4")
    assert "= 12 channels" in _usage_error(
        "--anchors", "2x2,1x1", "--classes", "1", "--size", "4x4x21"
    )
    for bad in ("1x2,0x1", "1x", "1x2x3", "ax1", "1x2,,2x1", "1xinf"):
        line = _usage_error("--anchors", bad)
        assert "expected WxH[,WxH...] with positive finite numbers (e.g. 1x2,1x1,2x1)" in line
    assert "'max' is not one of" in _usage_error("--reduction", "max")
    assert "0 is not in the range x>=1" in _usage_error("--classes", "0")
    line = _usage_error("--offset", "1,0")
    assert "--offset does not apply to yolo-loss" in line
    assert "--anchors" in line and "--classes" in line and "--rescore" in line
    line = _usage_error("--anchors", "1x1", family="loss-gradient")
    assert "--anchors does not apply to loss-gradient" in line
    line = _usage_error("--no-rescore", family="convolution")
    assert "--rescore does not apply to convolution" in line
