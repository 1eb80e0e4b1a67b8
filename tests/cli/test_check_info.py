"""`mpsnn check` and `mpsnn info` through click's CliRunner: every family passes on the CPU,
geometries with offsets, clip rects, edge modes, strides and dilations, the JSON report, the
adjoint numbers, planted errors that must fail, and one-line usage errors (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import mpsnn as m
import mpsnn.cnn.convolution.kernels as conv_kernels
from mpsnn.cli import main
from mpsnn.cli.families import FAMILIES
from tests.cli._helpers import check_report as _report
from tests.cli._helpers import invoke_check as _invoke
from tests.cli._helpers import one_thread  # noqa: F401


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_passes_with_its_default_geometry(family) -> None:
    result = _invoke(family)
    assert result.exit_code == 0, result.output
    assert "PASSED: all" in result.stdout
    assert "adjoint test in float64 on the cpu" in result.stdout
    assert result.stderr == ""


GEOMETRIES = [
    ("convolution", "--stride", "2x2", "--offset", "1,0", "--edge-mode", "clamp"),
    ("convolution", "--kernel", "2x4", "--dilation", "2x1", "--padding", "same,remainder-bottom-right"),
    ("convolution", "--size", "7x9x6", "--groups", "3", "--out-channels", "6", "--padding", "valid"),
    ("convolution", "--source-channel-offset", "1", "--size", "6x6x5", "--destination-channel-offset", "2"),
    ("convolution", "--clip", "1,2,4,3", "--edge-mode", "clamp"),
    ("convolution", "--offset", "0,0,1", "--batch", "3", "--destination-size", "5x7"),
    ("convolution-transpose", "--kernel", "4x4", "--stride", "2x2", "--padding", "full"),
    ("convolution-transpose", "--stride", "2x3", "--edge-mode", "clamp"),
    ("fully-connected", "--kernel", "4x3", "--out-channels", "5", "--source-channel-offset", "1"),
    ("pooling-max", "--kernel", "3x3", "--stride", "2x2", "--edge-mode", "clamp"),
    ("pooling-max", "--kernel", "3x2", "--stride", "1x2", "--offset", "2,-1"),
    ("pooling-average", "--kernel", "3x3", "--padding", "tf-average-pooling", "--size", "7x7x2"),
    ("pooling-average", "--kernel", "3x3", "--stride", "1x1", "--padding", "same,exclude-edges"),
    ("pooling-l2", "--kernel", "3x3", "--padding", "full,top-left", "--edge-mode", "clamp"),
    ("dilated-pooling-max", "--dilation", "1x3", "--stride", "2x2", "--edge-mode", "clamp"),
    ("neuron", "--neuron", "power", "--a", "0.5", "--b", "3", "--c", "1.7"),
    ("neuron", "--neuron", "prelu", "--offset", "1,-2", "--edge-mode", "clamp"),
    ("neuron", "--neuron", "gelu", "--clip", "0,0,3,3"),
    ("softmax", "--source-channel-offset", "1", "--destination-channel-offset", "1"),
    ("log-softmax", "--offset", "1,0", "--edge-mode", "clamp", "--dtype", "float16"),
    ("upsampling-bilinear", "--scale", "3x2", "--align-corners"),
    ("upsampling-nearest", "--offset", "-1,1", "--edge-mode", "zero", "--clip", "0,1,9,6"),
    ("group-normalization", "--size", "6x5x6", "--groups", "3", "--dtype", "bfloat16"),
    ("instance-normalization", "--offset", "1,1", "--destination-size", "6x6"),
    ("dropout", "--keep-probability", "0.3", "--clip", "2,2,4,4"),
    ("pad", "--edge-mode", "mirror", "--pad-before", "3,1,1", "--pad-after", "0,2,2", "--fill-value", "-0.5"),
    ("pad", "--edge-mode", "mirror-with-edge"),
    ("slice", "--offset", "2,1", "--destination-size", "4x3", "--source-channel-offset", "1"),
    ("multiply", "--secondary-size", "8x1x4", "--dtype", "float64"),
    ("divide", "--secondary-size", "1x1x1", "--offset", "1,1", "--edge-mode", "clamp"),
]  # fmt: skip


@pytest.mark.parametrize("args", GEOMETRIES, ids=" ".join)
def test_geometries_pass(args) -> None:
    r = _report(*args)
    assert r["passed"], r["failures"]
    assert len(r["checks"]) >= 2 and r["adjoint"]


def test_the_json_report_has_every_field() -> None:
    r = _report("convolution", "--stride", "2x2", "--dtype", "float16", "--seed", "3")
    assert r["family"] == "convolution" and r["dtype"] == "float16" and r["device"] == "cpu"
    assert (r["forward_kernel"], r["gradient_kernel"]) == ("Convolution", "ConvolutionGradient")
    assert r["source_shape"] == [2, 4, 8, 8] and r["destination_shape"] == [2, 4, 4, 4]
    assert r["offset"] == [0, 0, 0] and r["offset_from"] == "the padding policy"  # centred
    assert "SIZE_SAME" in r["padding"] and r["edge_mode"] == "ZERO"
    assert r["torch_equivalent"].startswith("F.conv2d(") and r["torch_note"] is None
    assert r["tolerance"] == 5e-3 and r["passed"] and r["failures"] == []
    names = {(c["name"], c["reference"]) for c in r["checks"]}
    for out in ("forward", "data gradient", "weight gradient", "bias gradient"):
        assert {(out, "mpsnn float64 cpu"), (out, "PyTorch" if out == "forward" else "PyTorch autograd")} <= names  # fmt: skip
    for c in r["checks"]:
        assert {"max_abs_error", "relative_error", "tolerance", "passed"} <= set(c)
        assert c["relative_error"] <= c["tolerance"]
    assert r["checks"][0]["relative_error"] > 0  # float16 storage: the forward is not exact
    assert [a["input"] for a in r["adjoint"]] == ["x", "weights", "bias"]


def test_no_pytorch_equivalent_is_said_not_invented() -> None:
    for args, words in (
        (("convolution", "--clip", "1,1,4,4"), "clip rect"),
        (("convolution-transpose", "--edge-mode", "clamp"), "CLAMP"),
        (("dropout",), "mask"),
        (("pad", "--edge-mode", "mirror-with-edge"), "MIRROR_WITH_EDGE"),
        (("pooling-average", "--padding", "same,exclude-edges"), "EXCLUDE_EDGES"),
    ):
        r = _report(*args)
        assert r["torch_equivalent"] is None and words in r["torch_note"]
        assert "no PyTorch equivalent" in r["torch_note"]
        assert all(c["reference"] == "mpsnn float64 cpu" for c in r["checks"])
    table = " ".join(_invoke("convolution", "--clip", "1,1,4,4").stdout.split())
    assert "no PyTorch equivalent for this geometry" in table


def test_policy_destination_and_offset_are_reported() -> None:
    r = _report(
        "pooling-average", "--kernel", "3x3", "--padding", "tf-average-pooling", "--size", "8x8x2"
    )
    assert r["destination_shape"] == [2, 2, 4, 4] and r["edge_mode"] == "CLAMP"  # the policy's
    assert r["offset"] == [1, 1, 0]
    assert "ADD_REMAINDER_TO_BOTTOM_RIGHT" in r["padding"] and "tensorflow" in r["padding"]
    assert "F.avg_pool2d(F.pad(x, (0, 1, 0, 1))" in r["torch_equivalent"]  # TF: pad after only
    r = _report("convolution", "--offset", "2,-1", "--padding", "valid")
    assert r["offset"] == [2, -1, 0] and r["offset_from"] == "--offset"
    assert r["destination_shape"] == [2, 4, 6, 6]
    # x reads [1, 9): skip 1, pad 1 after; y reads [-2, 6): pad 2 before, drop 2 rows
    assert r["torch_equivalent"].startswith("F.conv2d(F.pad(x[..., :-2, 1:], (0, 1, 2, 0)), w, b")


def test_adjoint_numbers_agree_and_are_printed() -> None:
    for family, args in (("convolution", ()), ("pooling-max", ()), ("batch-normalization", ()),
                         ("divide", ("--secondary-size", "8x8x1"))):  # fmt: skip
        r = _report(family, *args)
        for a in r["adjoint"]:
            assert abs(a["lhs"]) > 1e-6, a  # random v, w: never a degenerate 0 = 0
            assert abs(a["lhs"] - a["rhs"]) <= a["tolerance"] * abs(a["lhs"]), a
            assert a["relative_difference"] <= a["tolerance"] and a["passed"]
    r = _report("divide", "--secondary-size", "8x8x1")
    assert [(a["input"], a["tolerance"], a["step"]) for a in r["adjoint"]] == [
        ("x", 1e-9, 1.0),  # affine in the dividend: exact differences
        ("y", 1e-6, 1e-5),  # not in the divisor: central differences
    ]
    table, r = _invoke("pooling-average").stdout, _report("pooling-average")
    assert f"<J v, w>  = {r['adjoint'][0]['lhs']:.15g}" in table  # both numbers, in full
    assert f"<v, g(w)> = {r['adjoint'][0]['rhs']:.15g}" in table


def test_a_planted_forward_error_fails_the_check(monkeypatch) -> None:
    original = conv_kernels.conv_forward
    monkeypatch.setattr(conv_kernels, "conv_forward", lambda *a: original(*a) + 1e-3)
    result = _invoke("convolution")
    assert result.exit_code == 1, result.output
    assert "FAILED: forward vs PyTorch: relative error" in result.stdout
    r = json.loads(_invoke("convolution", "--json").stdout)
    assert not r["passed"] and len(r["failures"]) == 1
    bad = [c for c in r["checks"] if not c["passed"]]
    assert [(c["name"], c["reference"]) for c in bad] == [("forward", "PyTorch")]
    assert bad[0]["max_abs_error"] == pytest.approx(1e-3, rel=1e-3)


def test_a_planted_gradient_error_fails_the_adjoint_test(monkeypatch) -> None:
    original = m.PoolingAverageGradient._backward_op
    monkeypatch.setattr(
        m.PoolingAverageGradient, "_backward_op", staticmethod(lambda g, x, geom: original(g, x, geom) * 1.001)
    )  # fmt: skip
    result = _invoke("pooling-average", "--json")
    assert result.exit_code == 1
    r = json.loads(result.stdout)
    assert any(f.startswith("adjoint test of the data gradient") for f in r["failures"])
    assert any(f.startswith("data gradient vs PyTorch autograd") for f in r["failures"])
    assert r["adjoint"][0]["relative_difference"] == pytest.approx(1e-3, rel=1e-2)


def _usage_error(*args: str) -> str:
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_usage_errors_are_one_line_with_the_valid_values() -> None:
    line = _usage_error("convolutio")
    assert "'convolutio' is not one of" in line and "'convolution'" in line and "'divide'" in line
    line = _usage_error()
    assert "Missing argument 'FAMILY'" in line and "pooling-max" in line
    line = _usage_error("convolution", "--size", "8x8")
    assert "--size" in line and "WxHxC" in line and "8x8x4" in line
    line = _usage_error("convolution", "--edge-mode", "wrap")
    assert "'zero', 'clamp', 'mirror', 'mirror-with-edge', 'constant'" in line
    line = _usage_error("pooling-max", "--edge-mode", "mirror")  # the kernel's own check
    assert "[PoolingMax] edge_mode must be one of ZERO, CLAMP, got MIRROR" in line
    line = _usage_error("convolution", "--clip", "20,0,2,2")
    assert "[Convolution] the clip rect must overlap the 8-pixel destination along x" in line
    line = _usage_error("softmax", "--kernel", "3x3")
    assert "--kernel does not apply to softmax" in line and "--offset" in line
    line = _usage_error("convolution", "--padding", "same,diagonal")
    assert "'diagonal'" in line and "top-left" in line and "tf-average-pooling" in line
    line = _usage_error("convolution", "--groups", "3")
    assert "groups must divide" in line
    line = _usage_error("convolution", "--source-channel-offset", "4")
    assert "must be < the source's 4 channels" in line
    line = _usage_error("neuron", "--neuron", "logarithm", "--c", "1")
    assert "LOGARITHM base c must be -1 (e) or positive and not 1" in line
    line = _usage_error("divide", "--clip", "-1,-1,20,20")  # the divisor reads ZERO edges
    assert "not finite even in float64" in line and "--edge-mode clamp" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_usage_error() -> None:
    line = _usage_error("convolution", "--device", "cuda")
    assert "CUDA is not available" in line and "valid: cpu" in line


def test_info_reports_versions_devices_and_data() -> None:
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    assert "torch" in result.stdout and "Triton fast paths" in result.stdout
    result = CliRunner().invoke(main, ["info", "--json"])
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert set(r) == {"versions", "cpu", "cuda", "cudnn", "triton_fast_paths", "fashion_mnist"}
    assert set(r["versions"]) == {"mpsnn", "python", "torch", "triton", "numpy", "safetensors"}
    assert r["versions"]["torch"] == torch.__version__ and r["cpu"]["threads"] >= 1
    assert r["cuda"]["available"] == torch.cuda.is_available()
    assert len(r["cuda"]["devices"]) == (torch.cuda.device_count() if r["cuda"]["available"] else 0)
    assert set(r["cudnn"]) == {"available", "version"}
    assert isinstance(r["triton_fast_paths"]["active"], bool) and r["triton_fast_paths"]["reason"]
    if not torch.cuda.is_available():
        assert r["triton_fast_paths"]["active"] is False
    data = r["fashion_mnist"]
    assert data["found"] == (data["path"] is not None) and data["found"] != (
        data["hint"] is not None
    )
