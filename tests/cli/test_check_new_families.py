"""`mpsnn check` of the Gram matrix, comparison, reduction, local correlation and resize families
through click's CliRunner: each passes with varied geometries against PyTorch (and autograd and
the adjoint test where there is a gradient), the forward-only families say so, planted errors
fail, and their options are usage errors elsewhere."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import mpsnn.cnn.compare as compare_module
import mpsnn.cnn.correlation as correlation_module
import mpsnn.cnn.gram as gram_module
import mpsnn.cnn.reduce as reduce_module
import mpsnn.cnn.resize as resize_module
from mpsnn.cli import main
from mpsnn.cli.families import FAMILIES, make_config
from mpsnn.cli.families_more import REDUCE_OPS
from tests.cli._helpers import check_report as _report
from tests.cli._helpers import invoke_check as _invoke
from tests.cli._helpers import one_thread  # noqa: F401


def _passes_against_pytorch(r: dict, gradient: bool) -> None:
    assert r["passed"], r["failures"]
    refs = {(c["name"], c["reference"]) for c in r["checks"]}
    assert ("forward", "PyTorch") in refs, r["torch_note"]
    assert (("data gradient", "PyTorch autograd") in refs) is gradient
    assert bool(r["adjoint"]) is gradient
    for c in r["checks"]:
        assert c["relative_error"] <= c["tolerance"]


GRADIENT_GEOMETRIES = [
    ("gram",),
    ("gram", "--alpha", "-1.5", "--source-channel-offset", "1", "--destination-channel-offset", "2"),
    ("gram", "--size", "5x3x6", "--dtype", "float64", "--batch", "3"),
    ("gram", "--dtype", "bfloat16", "--alpha", "0.125"),
    ("resize-bilinear",),
    ("resize-bilinear", "--resize", "3x13", "--align-corners", "--dtype", "float64"),
    ("resize-bilinear", "--resize", "8x8", "--source-channel-offset", "1", "--destination-channel-offset", "1"),
    ("resize-bilinear", "--size", "1x6x2", "--resize", "4x2", "--dtype", "float16"),
    ("crop-and-resize-bilinear",),
    ("crop-and-resize-bilinear", "--resize", "1x1", "--region", "0.2,0.1,0.5,0.5", "--region", "0.9,0.9,-0.8,-0.3"),
    ("crop-and-resize-bilinear", "--region", "-0.5,0.25,2,0.5", "--resize", "6x2", "--dtype", "float64"),
    ("crop-and-resize-bilinear", "--source-channel-offset", "2", "--destination-channel-offset", "1"),
]  # fmt: skip


@pytest.mark.parametrize("args", GRADIENT_GEOMETRIES, ids=" ".join)
def test_gram_and_resize_families_pass_against_pytorch_and_autograd(args) -> None:
    r = _report(*args)
    _passes_against_pytorch(r, gradient=True)
    assert all(a["lhs"] != 0 and a["passed"] for a in r["adjoint"])


def test_the_references_name_what_they_compute() -> None:
    r = _report("gram", "--alpha", "0.5", "--source-channel-offset", "1")
    assert r["torch_equivalent"] == (
        '0.5 * torch.einsum("nihw,njhw->nij", x[:, 1:4], x[:, 1:4]).unsqueeze(2)'
    )
    assert r["destination_shape"] == [2, 3, 1, 3]
    assert (r["forward_kernel"], r["gradient_kernel"]) == (
        "GramMatrixCalculation", "GramMatrixCalculationGradient",
    )  # fmt: skip
    r = _report("resize-bilinear", "--resize", "5x3", "--align-corners")
    assert r["torch_equivalent"] == (
        'F.interpolate(x, size=(3, 5), mode="bilinear", align_corners=True)'
    )
    assert r["edge_mode"] == "CLAMP"
    r = _report("crop-and-resize-bilinear", "--region", "0,0,1,1", "--resize", "8x8")
    assert r["destination_shape"] == [2, 4, 8, 8] and "F.grid_sample" in r["torch_equivalent"]


def test_geometries_without_a_pytorch_equivalent_say_so() -> None:
    for args, words in (
        (("resize-bilinear", "--edge-mode", "zero"), "ZERO edges"),
        (("resize-bilinear", "--offset", "1,0"), "an offset"),
        (("crop-and-resize-bilinear", "--clip", "0,0,2,2"), "clip rect"),
        (("crop-and-resize-bilinear", "--destination-size", "6x6"), "another destination size"),
    ):
        r = _report(*args)
        assert r["passed"] and r["torch_equivalent"] is None, args
        assert words in r["torch_note"] and "no PyTorch equivalent" in r["torch_note"]
        assert r["adjoint"] and all(a["passed"] for a in r["adjoint"])


@pytest.mark.parametrize("op", list(REDUCE_OPS))
def test_every_reduction_passes_against_pytorch(op) -> None:
    r = _report("reduce", "--op", op, "--source-clip", "1,2,5,4")
    _passes_against_pytorch(r, gradient=False)
    cls, _ = REDUCE_OPS[op]
    assert (r["forward_kernel"], r["gradient_kernel"]) == (cls.__name__, None)
    if op.startswith("row"):
        assert r["destination_shape"] == [2, 4, 4, 1]
    elif op.startswith("column"):
        assert r["destination_shape"] == [2, 4, 1, 5]
    else:
        assert r["destination_shape"] == [2, 1, 4, 5]


REDUCE_GEOMETRIES = [
    ("reduce", "--op", "feature-channels-sum", "--weight", "-0.5", "--dtype", "float64"),
    ("reduce", "--op", "column-mean", "--source-channel-offset", "2", "--destination-channel-offset", "1"),
    ("reduce", "--op", "feature-channels-argument-max", "--size", "6x5x7", "--dtype", "float16"),
    ("reduce", "--op", "row-min", "--source-clip", "-2,-1,4,20"),
    ("reduce", "--op", "feature-channels-and-weights-sum", "--secondary-size", "8x8x4"),
    ("reduce", "--op", "feature-channels-and-weights-sum-by-non-zero-weights", "--source-clip", "0,0,3,3", "--source-channel-offset", "1"),
    ("reduce", "--op", "feature-channels-and-weights-mean", "--destination-channel-offset", "2", "--dtype", "bfloat16"),
    ("local-correlation", "--window", "0,0"),
    ("local-correlation", "--window", "1,2", "--stride", "2x1", "--dtype", "float64"),
    ("local-correlation", "--source-clip", "1,1,5,6", "--source-channel-offset", "1", "--destination-channel-offset", "1"),
    ("local-correlation", "--secondary-size", "5x6x4"),
    ("local-correlation", "--secondary-size", "10x9x4", "--window", "3,1"),
    ("compare", "--comparison", "not-equal"),
    ("compare", "--comparison", "less", "--threshold", "0.5"),
    ("compare", "--comparison", "less-or-equal", "--secondary-size", "8x1x4"),
    ("compare", "--comparison", "greater", "--threshold", "1", "--dtype", "bfloat16"),
    ("compare", "--comparison", "greater-or-equal", "--secondary-size", "1x1x1", "--dtype", "float64"),
    ("compare", "--threshold", "0.5", "--destination-channel-offset", "1"),
]  # fmt: skip


@pytest.mark.parametrize("args", REDUCE_GEOMETRIES, ids=" ".join)
def test_forward_only_families_pass_against_pytorch(args) -> None:
    r = _report(*args)
    _passes_against_pytorch(r, gradient=False)
    assert [c["name"] for c in r["checks"]] == ["forward", "forward"]


def test_forward_only_families_say_so_in_the_table() -> None:
    for family in ("compare", "reduce", "local-correlation"):
        result = _invoke(family)
        assert result.exit_code == 0, result.output
        out = " ".join(result.stdout.split())
        assert "(forward only: no gradient kernel)" in out
        assert "adjoint test in float64 on the cpu: none (no gradient)" in out
        assert "PASSED: all 2 checks within tolerance" in out


def test_comparisons_meet_equal_values() -> None:
    """The inputs lie on a grid, so every comparison sees ties: EQUAL and NOT_EQUAL both
    hold somewhere, and the threshold changes the result."""
    fam = FAMILIES["compare"]
    ys = {}
    for comparison, threshold in (("equal", 0.0), ("equal", 0.5)):
        cfg = make_config(
            fam, {"size": (8, 8, 4), "comparison": comparison, "threshold": threshold}
        )
        values = fam.inputs(cfg, torch.Generator().manual_seed(0))
        ys[threshold] = fam.run(cfg, values, "cpu", torch.float64).y
    assert 0 < float(ys[0.0].mean()) < float(ys[0.5].mean()) < 1


def test_planted_errors_fail(monkeypatch) -> None:
    original = gram_module.gram_forward
    monkeypatch.setattr(gram_module, "gram_forward", lambda x, a: original(x, a) * 1.001)
    r = json.loads(_invoke("gram", "--json").stdout)
    assert not r["passed"]
    assert any(f.startswith("forward vs PyTorch: relative error") for f in r["failures"])
    monkeypatch.undo()

    original_crop = resize_module.crop_backward
    monkeypatch.setattr(
        resize_module, "crop_backward", lambda g, ay, ax: original_crop(g, ay, ax) * 1.001
    )
    result = _invoke("crop-and-resize-bilinear", "--json")
    assert result.exit_code == 1
    r = json.loads(result.stdout)
    assert any(f.startswith("adjoint test of the data gradient") for f in r["failures"])
    assert any(f.startswith("data gradient vs PyTorch autograd") for f in r["failures"])
    monkeypatch.undo()

    original_block = reduce_module.reduce_block
    monkeypatch.setattr(
        reduce_module, "reduce_block", lambda *a, **k: original_block(*a, **k) + 1e-3
    )
    r = json.loads(_invoke("reduce", "--op", "column-max", "--json").stdout)
    assert not r["passed"] and "forward vs PyTorch: relative error" in r["failures"][-1]
    monkeypatch.undo()

    original_corr = correlation_module.local_correlation
    monkeypatch.setattr(
        correlation_module, "local_correlation", lambda *a: original_corr(*a).flip(1)
    )
    assert _invoke("local-correlation").exit_code == 1
    monkeypatch.undo()

    original_cmp = compare_module.compare
    monkeypatch.setattr(
        compare_module, "compare", lambda kind, t, a, b: 1 - original_cmp(kind, t, a, b)
    )
    result = _invoke("compare", "--comparison", "less")
    assert result.exit_code == 1 and "FAILED: forward vs PyTorch" in result.stdout


def _usage_error(*args: str) -> str:
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def test_usage_errors_are_one_line() -> None:
    line = _usage_error("gram", "--op", "row-sum")
    assert "--op does not apply to gram" in line and "--alpha" in line
    line = _usage_error("reduce", "--op", "row-median")
    assert "'row-median' is not one of" in line and "'feature-channels-argument-max'" in line
    line = _usage_error("crop-and-resize-bilinear", "--region", "0.1,0.2,0.3")
    assert "expected X,Y,W,H as 4 numbers" in line
    line = _usage_error("crop-and-resize-bilinear", "--offset", "1,0")
    assert "--offset does not apply to crop-and-resize-bilinear" in line
    line = _usage_error("compare", "--comparison", "about")
    assert "'greater-or-equal'" in line
    line = _usage_error("compare", "--threshold", "-1")
    assert "--threshold" in line
    line = _usage_error("local-correlation", "--window", "-1,0")
    assert "X >= 0" in line
    line = _usage_error("reduce", "--source-clip", "20,0,2,2")
    assert "[ReduceRowSum] clip_rect_source must overlap" in line
    line = _usage_error("resize-bilinear", "--resize", "0x3")
    assert "positive integers" in line


def test_help_lists_the_new_families_and_options() -> None:
    result = CliRunner().invoke(main, ["check", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    for name in ("gram", "compare", "reduce", "local-correlation", "resize-bilinear",
                 "crop-and-resize-bilinear", "--alpha", "--comparison", "--threshold", "--op",
                 "--weight", "--source-clip", "--window", "--resize", "--region"):  # fmt: skip
        assert name in text, name
    assert "check the forward only" in text
