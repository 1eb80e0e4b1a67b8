"""The float32 precision contract: what arithmetic mpsnn's float32 convolutions and matrix
products run in.

MPS's float32 is float32 arithmetic, and so is mpsnn's on every device by default: a
``FLOAT32`` convolution (forward, gradients, transpose) or fully connected layer multiplies
and accumulates float32 values, never TensorFloat-32 (TF32: 10-bit mantissa products, which
PyTorch lets cuDNN convolutions use by default on Ampere and later GPUs). One switch, named
after PyTorch's, opts in:

* ``"highest"`` (default): float32 arithmetic; TF32 off for mpsnn's work.
* ``"high"``: TF32 allowed for mpsnn's float32 convolutions and matrix products on CUDA.
* ``"medium"``: as PyTorch defines it, bfloat16-internal products where such algorithms exist,
  else TF32. mpsnn's CUDA paths have none (cuBLAS and cuDNN offer TF32 only), so it means what
  ``"high"`` means.

The switch decides alone: mpsnn sets PyTorch's per-operator CUDA float32 precision (cuDNN
convolutions and cuBLAS matrix products) around each of its own float32 CUDA calls and puts
the user's values back right after (on success or error), so ``torch.backends.cudnn.allow_tf32``,
``torch.backends.cuda.matmul.allow_tf32`` and ``torch.get_float32_matmul_precision()`` read
what the user set, outside mpsnn's calls. The precision in force when a CUDA graph is captured
is the one its kernels replay with; captures run through the same calls, under the same rule.

Other dtypes and devices are untouched: TF32 exists for float32 on CUDA only (float64 and the
16-bit formats are unaffected; on the CPU mpsnn calls PyTorch as it is configured).

Like PyTorch's own flags, the switch and the flags it sets are process-wide: another thread
that runs PyTorch float32 CUDA convolutions while an mpsnn call is in flight sees mpsnn's
precision for that moment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = [
    "describe",
    "float32_call",
    "float32_conv_call",
    "get_float32_matmul_precision",
    "set_float32_matmul_precision",
    "tf32_allowed",
]

T = TypeVar("T")

PRECISIONS = ("highest", "high", "medium")

_F32 = torch.float32
_C: Any = torch._C

# Recent PyTorch keeps one float32 precision per backend and operator ("ieee" / "tf32", or
# "none": inherit from ("cuda", "all"), then ("generic", "all")); its cuDNN convolutions and
# cuBLAS products read ("cuda", "conv") and ("cuda", "matmul"), so setting those two explicitly
# decides whatever the user set elsewhere. PyTorch without these setters reads the legacy
# booleans (`_under_legacy_flags`).
_get_precision: Any = getattr(_C, "_get_fp32_precision_getter", None)
_set_precision: Any = getattr(_C, "_set_fp32_precision_setter", None)


def _per_operator_api() -> bool:
    """Whether this PyTorch takes ``"ieee"`` per operator (probed once, state restored)."""
    if _get_precision is None or _set_precision is None:
        return False
    try:
        saved = _get_precision("cuda", "conv")
        _set_precision("cuda", "conv", "ieee")
    except (RuntimeError, TypeError, ValueError):
        return False
    _set_precision("cuda", "conv", saved)
    return True


_PER_OPERATOR = _per_operator_api()

# The state of the switch: its name and the per-operator precision mpsnn's float32 CUDA work
# runs under (module globals: read on every guarded call).
_precision = "highest"
_mode = "ieee"


def set_float32_matmul_precision(precision: str) -> None:
    """Set the arithmetic of mpsnn's float32 convolutions and matrix products on CUDA.

    Args:
        precision: ``"highest"`` (float32 arithmetic, the default), ``"high"`` (TF32 allowed),
            or ``"medium"`` (PyTorch's name for bfloat16-internal products where available,
            else TF32: TF32 for mpsnn). See the module docstring.

    Raises:
        TypeError: ``precision`` is not a str.
        ValueError: ``precision`` is not one of the three names.

    PyTorch's own settings (``torch.set_float32_matmul_precision``,
    ``torch.backends.cudnn.allow_tf32``) are neither read nor changed by this switch.
    """
    global _precision, _mode
    if not isinstance(precision, str):
        raise TypeError(
            f"[set_float32_matmul_precision] precision must be a str, got "
            f"{type(precision).__name__}"
        )
    if precision not in PRECISIONS:
        raise ValueError(
            f"[set_float32_matmul_precision] precision must be one of "
            f"{', '.join(map(repr, PRECISIONS))}, got {precision!r}"
        )
    _precision = precision
    _mode = "ieee" if precision == "highest" else "tf32"


def get_float32_matmul_precision() -> str:
    """The current setting of `set_float32_matmul_precision` (``"highest"`` by default)."""
    return _precision


def describe() -> dict[str, Any]:
    """mpsnn's float32 precision and PyTorch's own TF32 settings (which PyTorch's operators
    outside mpsnn run under), for the headers of benchmarks and reports."""
    return {
        "mpsnn_float32_matmul_precision": _precision,
        "mpsnn_tf32": _mode == "tf32",
        "torch_cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "torch_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "torch_float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def tf32_allowed(dtype: torch.dtype, device_type: str) -> bool:
    """Whether mpsnn's convolutions and matrix products on ``dtype`` tensors of a
    ``device_type`` device may use TF32: float32 on CUDA under ``"high"`` or ``"medium"``;
    never for other dtypes or devices (TF32 does not apply there)."""
    return dtype is _F32 and device_type == "cuda" and _mode == "tf32"


def float32_call(fn: Callable[..., T], x: torch.Tensor, *args: Any) -> T:
    """``fn(*args)``, a cuBLAS matrix product of mpsnn on operand ``x``: for a float32 CUDA
    ``x``, run under the precision of `set_float32_matmul_precision` with PyTorch's setting
    restored afterwards; else as is (no cost beyond two attribute reads)."""
    if x.dtype is not _F32 or not x.is_cuda:
        return fn(*args)
    return _under_mode(fn, args, "matmul")


def float32_conv_call(fn: Callable[..., T], x: torch.Tensor, *args: Any) -> T:
    """`float32_call` for a convolution (cuDNN's setting; cuBLAS's too when the user turned
    cuDNN off, since PyTorch then computes convolutions as matrix products)."""
    if x.dtype is not _F32 or not x.is_cuda:
        return fn(*args)
    if _C._get_cudnn_enabled():
        return _under_mode(fn, args, "conv")
    return _under_mode(_under_mode, (fn, args, "conv"), "matmul")


def _under_mode(fn: Callable[..., T], args: tuple[Any, ...], op: str) -> T:
    """``fn(*args)`` with PyTorch's float32 precision of CUDA operator ``op`` ("conv" or
    "matmul") set to mpsnn's mode; one read and two writes of the setting, or one read when
    it already is the mode."""
    if not _PER_OPERATOR:
        return _under_legacy_flags(fn, args)
    mode = _mode
    saved = _get_precision("cuda", op)
    if saved == mode:
        return fn(*args)
    _set_precision("cuda", op, mode)
    try:
        return fn(*args)
    finally:
        _set_precision("cuda", op, saved)


def _under_legacy_flags(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    """`_under_mode` for a PyTorch without per-operator precisions: its two booleans (and the
    float32 matmul precision that the cuBLAS boolean is part of) are set and restored."""
    allow = _mode == "tf32"
    conv = _C._get_cudnn_allow_tf32()
    matmul = _C._get_float32_matmul_precision()
    _C._set_cudnn_allow_tf32(allow)
    _C._set_float32_matmul_precision("high" if allow else "highest")
    try:
        return fn(*args)
    finally:
        _C._set_cudnn_allow_tf32(conv)
        _C._set_float32_matmul_precision(matmul)
