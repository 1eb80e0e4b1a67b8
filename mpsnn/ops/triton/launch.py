"""Cheaper Triton launches: the compiled kernel looked up by a key of our own.

At every launch ``fn[grid](*args)`` Triton binds the arguments, specializes each of them (the
dtype of a tensor and whether its address is a multiple of 16; the width of an integer, whether
it is divisible by 16 and whether it equals 1), builds a cache-key string from that, looks the
compiled kernel up and checks the globals it used. On a slow host that costs about 20 µs, as
much as the launch itself, and mpsnn launches small kernels at every command (a dropout, a
max-pool gradient, an optimizer step).

`FastKernel` wraps a ``@triton.jit`` function and keeps, per *argument key*, the kernel Triton
compiled for it. The key holds, for each argument, the properties Triton specializes on, and
constexprs (positional or keyword) and launch options by type and value, under the current CUDA
device (Triton compiles, and loads a kernel, per device): a finer partition than Triton's own,
so two calls with one key get one Triton specialization.
A call whose key was seen launches the `CompiledKernel` directly on the current stream, with
the same arguments in the same order as Triton's own path would. The key itself is built by a
function generated once per *call shape* (the arguments' types and the keywords' names,
`_keyer`): one tuple expression with no per-argument dispatch, equal to `_key`'s result.

Triton's own path still runs:

* for the first call of each key (it compiles, or finds the compiled kernel, and launches);
* for an argument this cannot key (a type other than tensor, int, float, bool, None or a
  tuple of these, or a tensor passed by keyword);
* under the interpreter (``TRITON_INTERPRET=1``), which has no compiled kernels;
* while a Triton launch hook is installed (a profiler), so the hook sees every launch;
* for a grid given as a callable;
* when the installed Triton's compiled kernels lack what the direct launch uses.

Triton's global settings (``knobs``: debug mode, instrumentation) are read when a key is first
seen: change them before launching, not between launches.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from mpsnn.core.device import _raw_stream

__all__ = ["FastKernel", "cdiv", "fast_kernel", "next_power_of_2", "sm_count"]

_I32 = (-(1 << 31), 1 << 31)
_U64 = 1 << 63
_PLAIN = (int, bool, float, str, type(None))  # keyword values hashable as they are
# the current CUDA device (-1 without CUDA: the interpreter, where nothing is launched directly)
_get_device: Callable[[], int] = (
    getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
    if torch.cuda.is_available()
    else (lambda: -1)
)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host-side grid and tile sizes. Triton's own ``triton.cdiv`` is a
    `constexpr` function whose wrapper unwraps its arguments at every call (microseconds on a
    slow host, and a normalization layer's step makes a dozen such calls)."""
    return -(-a // b)


@functools.cache
def sm_count(index: int) -> int:
    """The streaming multiprocessors of CUDA device ``index`` (asked once: launch plans read
    it at every call)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 ``>= n`` for ``n >= 1`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _knobs() -> Any:
    try:
        from triton import knobs
    except ImportError:  # an older Triton: no launch hooks to honour there
        return None
    return knobs.runtime


class FastKernel:
    """A ``@triton.jit`` function launched as ``kernel[grid](*args, **constexprs)``, with the
    compiled kernel looked up by `_key` instead of Triton's binder (see the module)."""

    __slots__ = (
        "_compiled", "_constexpr", "_defaults", "_keyers", "_names", "direct_launches", "fn",
    )  # fmt: skip

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        params = list(inspect.signature(fn.fn).parameters.values())
        self._names = [p.name for p in params]
        self._defaults = {
            p.name: p.default for p in params if p.default is not inspect.Parameter.empty
        }
        # positions of the constexpr parameters (annotated ``tl.constexpr``, as Triton tells
        # them): keyed by value when passed positionally
        self._constexpr = frozenset(
            i for i, p in enumerate(params) if "constexpr" in str(p.annotation)
        )
        # key -> (launcher, function, packed metadata, trailing args), or None: Triton's path
        self._compiled: dict[Any, tuple[Any, ...] | None] = {}
        # (argument types, keyword names) -> `_keyer` for such calls (None: `_key` per call)
        self._keyers: dict[tuple[Any, ...], Callable[..., Any] | None] = {}
        self.direct_launches = 0  # how many launches skipped Triton's binder (for tests)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        device = _get_device()  # Triton compiles per device: a kernel's handle is for one
        if callable(grid):
            key = None
        else:
            shape: tuple[Any, ...] = (*map(type, args), *kwargs)  # the types, the keywords
            keyer = self._keyers.get(shape, _MISSING)
            if keyer is _MISSING:
                n = len(args)
                keyer = self._keyers[shape] = _keyer(shape[:n], shape[n:], self._constexpr)
            key = _key(args, kwargs, self._constexpr) if keyer is None else keyer(args, kwargs)
        if key is not None:
            key = (device, key)
        entry = self._compiled.get(key, _MISSING) if key is not None else None
        if entry is _MISSING:
            kernel = self.fn[grid](*args, **kwargs)
            self._compiled[key] = self._direct(kernel, args, kwargs)
            return
        if entry is None or (
            _HOOKS is not None
            and (_hooked(_HOOKS.launch_enter_hook) or _hooked(_HOOKS.launch_exit_hook))
        ):
            self.fn[grid](*args, **kwargs)
            return
        run, function, packed, tail = entry
        stream = _raw_stream(device)  # type: ignore[misc]
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, function, packed,
            None, None, None, *args, *tail)  # fmt: skip
        self.direct_launches += 1

    def _direct(
        self, kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, ...] | None:
        """What a direct launch of ``kernel`` needs, or None where it cannot be done."""
        if _raw_stream is None or kernel is None:
            return None
        try:
            kernel._init_handles()
            run, function, packed = kernel.run, kernel.function, kernel.packed_metadata
        except AttributeError:  # the interpreter, or a Triton without these
            return None
        if not callable(run) or function is None:
            return None
        # the parameters after the positional ones, in signature order: the keyword
        # arguments (keyed by value) and the defaults; Triton's launcher takes them all
        tail = []
        for name in self._names[len(args) :]:
            if name in kwargs:
                tail.append(kwargs[name])
            elif name in self._defaults:
                tail.append(self._defaults[name])
            else:
                return None
        return run, function, packed, tuple(tail)


def fast_kernel(fn: Any) -> FastKernel:
    """Wrap a ``@triton.jit`` kernel for cheaper launches (see `FastKernel`)."""
    return FastKernel(fn)


_MISSING: Any = object()
_HOOKS = _knobs()


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is installed: a callable, or a non-empty chain of them (Triton
    3.5 and later keep an empty `HookChain` there by default)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def _keyer(
    types: tuple[type, ...], names: tuple[str, ...], constexpr: frozenset[int]
) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, ...] | None] | None:
    """A function ``(args, kwargs) -> _key(args, kwargs, constexpr)`` for calls whose
    arguments have exactly the types ``types`` and whose keywords are ``names`` in that order,
    or None where `_key` itself decides per call (a type it keys by isinstance).

    Generated once per call shape: the key's items are one tuple expression, with no loop or
    type dispatch per argument (a launch's key is built on the host at every launch, and the
    dispatch cost about as much as the launch). A keyword value of a type `_key` checks for
    hashability falls back to `_key`."""
    items: list[str] = []
    env: dict[str, Any] = {"_key": _key, "_PLAIN": _PLAIN, "_constexpr": constexpr}
    for i, t in enumerate(types):
        a = f"a{i}"
        if t is torch.Tensor:
            items.append(f"{a}.dtype, not {a}.data_ptr() & 15")
        elif i in constexpr:
            env[f"T{i}"] = t
            items.append(f"T{i}, {a}")
        elif t is int:
            items.append(f"'i', {a} == 1, not {a} & 15, {_I32[0]} <= {a} < {_I32[1]}, {a} < {_U64}")
        elif t is bool:
            items.append("'b'")
        elif t is float:
            items.append("'f'")
        elif t is type(None):
            items.append("None")
        else:  # a type `_key` keys per call (a tensor subclass, a tuple) or refuses
            return None
    checks = []
    for j, name in enumerate(names):
        env[f"N{j}"] = name
        checks.append(f"type(k{j}) in _PLAIN")
        items.append(f"N{j}, type(k{j}), k{j}")
    unpack_args = "".join(f"a{i}, " for i in range(len(types)))
    unpack_kw = "".join(f"    k{j} = kwargs[N{j}]\n" for j in range(len(names)))
    fallback = (
        f"    if not ({' and '.join(checks)}):\n        return _key(args, kwargs, _constexpr)\n"
        if checks
        else ""
    )
    src = (
        "def keyer(args, kwargs):\n"
        + (f"    {unpack_args}= args\n" if types else "")
        + unpack_kw
        + fallback
        + f"    return ({len(types)}, {''.join(x + ', ' for x in items)})\n"
    )
    exec(compile(src, f"<mpsnn launch key {types}>", "exec"), env)
    return env["keyer"]


def _key(
    args: tuple[Any, ...], kwargs: dict[str, Any], constexpr: frozenset[int] = frozenset()
) -> tuple[Any, ...] | None:
    """The properties of the arguments Triton specializes on (``constexpr``: positions keyed
    by type and value); None when one cannot be keyed.

    One flat tuple, the count of positional arguments first (so that keywords cannot read as
    positional items: ``f=1.0`` against a float and a constexpr). Each argument adds a tag that
    fixes how many items follow (a tensor's dtype, then its 16-byte alignment; ``"i"`` and four
    properties of an int; ``"b"``, ``"f"`` or None alone; a constexpr's type, then its value;
    ``"t"``, a tuple's length, then its elements' items), so two argument lists with one key
    specialize alike. Flat, because a launch builds it on the host: no tuple per argument."""
    key: list[Any] = [len(args)]  # the count first: the flat items then parse one way only
    add = key.append
    for i, a in enumerate(args):
        t = type(a)
        if t is torch.Tensor:  # the common case first (never a constexpr)
            add(a.dtype)
            add(not a.data_ptr() & 15)
        elif i in constexpr:
            add(t)
            add(a)
        elif t is int:
            add("i")
            add(a == 1)
            add(not a & 15)
            add(_I32[0] <= a < _I32[1])
            add(a < _U64)
        elif t is bool:
            add("b")
        elif t is float:
            add("f")
        elif a is None:
            add(None)
        elif isinstance(a, torch.Tensor):
            add(a.dtype)
            add(not a.data_ptr() & 15)
        elif t is tuple:  # Triton specializes each element as an argument of its own
            add("t")
            add(len(a))
            items = _key(a, {})
            if items is None:
                return None
            key.extend(items[1:])
        else:
            return None
    for k, v in kwargs.items():
        if type(v) not in _PLAIN:
            if isinstance(v, torch.Tensor | tuple):
                # a tensor by keyword, or a tuple (which may hold tensors: keyed by identity,
                # each new one would make and pin an entry)
                return None
            try:
                hash(v)
            except TypeError:  # a value a key cannot hold (a list)
                return None
        # by type too: Triton compiles FLAG=True, FLAG=1 and FLAG=1.0 apart (they are ==)
        add(k)
        add(type(v))
        add(v)
    return tuple(key)
