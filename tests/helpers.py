"""Shared test helpers: comparisons with a per-dtype tolerance table, the adjoint test, devices.

The references in `tests/reference.py` are written from the documented formulas
(docs/semantics.md), not from mpsnn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

import mpsnn as m

# Relative-norm tolerance ||a - e|| / ||e|| per storage dtype (inputs rounded to that dtype,
# reference computed in float64 on the rounded inputs). float16 keeps 11 bits, bfloat16 8.
TOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-6,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Triton kernels run compiled on CUDA tensors, or in Triton's interpreter on CPU tensors when
# there is no GPU (tests/conftest.py turns the interpreter on then).
TRITON_DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
FORMATS = {
    torch.float32: m.FeatureChannelFormat.FLOAT32,
    torch.float16: m.FeatureChannelFormat.FLOAT16,
    torch.bfloat16: m.FeatureChannelFormat.BFLOAT16,
    torch.float64: m.FeatureChannelFormat.FLOAT64,
}


def as_f64(t: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(t, np.ndarray):
        return torch.from_numpy(t).double()
    return t.detach().cpu().double()


def assert_close(actual, expected, what: str, tol: float | None = None, dtype=None) -> None:
    """Shape, then values: relative-norm error within the dtype's tolerance (or ``tol``)."""
    a, e = as_f64(actual), as_f64(expected)
    assert tuple(a.shape) == tuple(e.shape), f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    if tol is None:
        tol = TOL[dtype if dtype is not None else getattr(actual, "dtype", torch.float64)]
    scale = e.norm().item()
    err = (a - e).norm().item()
    if scale == 0:
        assert err <= tol, f"{what}: expected zeros, got norm {err:.3e}"
    else:
        assert err <= tol * scale, f"{what}: relative error {err / scale:.3e} > {tol:.1e}"


def assert_adjoint(
    jv: torch.Tensor, w: torch.Tensor, v: torch.Tensor, jtw: torch.Tensor, what: str, tol=1e-9
) -> None:
    """``<J v, w> == <v, J^T w>`` in float64."""
    lhs = (as_f64(jv) * as_f64(w)).sum().item()
    rhs = (as_f64(v) * as_f64(jtw)).sum().item()
    scale = max(abs(lhs), abs(rhs), 1e-30)
    assert abs(lhs - rhs) <= tol * scale, f"{what}: <Jv,w>={lhs!r} != <v,J^T w>={rhs!r}"
    assert abs(lhs) > 1e-12, f"{what}: degenerate adjoint test (<Jv,w> = {lhs})"


@contextlib.contextmanager
def float32_reference() -> Iterator[None]:
    """PyTorch's float32 CUDA convolutions and matrix products in float32 arithmetic (TF32 off)
    for a reference computed inside the block; PyTorch's flags are restored afterwards. The
    tests run under PyTorch's defaults, which let cuDNN convolutions use TF32."""
    with torch_tf32(False):
        yield


@contextlib.contextmanager
def torch_tf32(allowed: bool) -> Iterator[None]:
    """PyTorch's own TF32 flags (cuDNN and cuBLAS) set to ``allowed`` inside the block."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def run(cb: m.CommandBuffer) -> None:
    cb.commit()
    cb.wait_until_completed()


def randn(*shape, dtype=torch.float64, device="cpu", gen=None) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same dtype, shape and bits, NaNs by position (a NaN's payload may differ)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan()
    view = torch.int16 if got.dtype != torch.float32 else torch.int32
    assert torch.equal(got[keep].view(view), want[keep].view(view))
