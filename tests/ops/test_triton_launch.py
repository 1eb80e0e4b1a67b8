"""Direct Triton launches (`mpsnn.ops.triton.launch`): the argument key separates every case
Triton compiles separately, a repeated key launches the compiled kernel directly with the same
results as Triton's own path, and the cases that must take Triton's path do (the interpreter,
an argument that cannot be keyed, a launch hook)."""

from __future__ import annotations

import pytest
import torch

from mpsnn.ops.triton import elementwise, launch
from mpsnn.ops.triton.elementwise import _add_relu, add_relu_triton
from mpsnn.ops.triton.launch import FastKernel, _key, cdiv, next_power_of_2
from tests.helpers import TRITON_DEVICES

CUDA = torch.cuda.is_available()


def test_host_helpers_equal_tritons() -> None:
    """The plain-int grid helpers give what ``triton.cdiv`` / ``triton.next_power_of_2`` give."""
    import triton

    for n in [*range(0, 300), 4095, 4096, 4097, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64, 4096):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)


def test_key_separates_what_triton_specializes_on() -> None:
    base = torch.zeros(64)
    # integers: 1 (a constant for Triton), divisibility by 16, 32-bit range, unsigned 64-bit
    ints = [1, 2, 3, 16, 32, 0, -16, 17, 2**31 - 16, 2**31, -(2**31), -(2**31) - 16, 2**63]
    keys = {i: _key((i,), {}) for i in ints}
    assert keys[2] == keys[3] and keys[16] == keys[32] == keys[0] == keys[-16]
    assert keys[1] != keys[2] and keys[2] != keys[16]
    assert keys[2**31 - 16] == keys[16] and keys[2**31] != keys[16]
    assert keys[-(2**31)] == keys[16] and keys[-(2**31) - 16] == keys[2**31]
    assert keys[2**63] != keys[2**31]
    # tensors: dtype and whether the address is a multiple of 16 bytes
    assert _key((base,), {}) == _key((torch.zeros(8),), {})
    assert _key((base[1:],), {}) != _key((base,), {})  # 4 bytes in: misaligned
    assert _key((base[4:],), {}) == _key((base,), {})  # 16 bytes in: aligned
    assert _key((base.to(torch.bfloat16),), {}) != _key((base,), {})
    # bools and floats are not specialized; a bool is not the int 1
    assert _key((True,), {}) == _key((False,), {}) != _key((1,), {})
    assert _key((0.5,), {}) == _key((3.0,), {})
    # constexprs and launch options by type and value; the argument count is part of the key
    assert _key((2,), {"BLOCK": 64}) != _key((2,), {"BLOCK": 128})
    assert _key((2,), {"F": True}) != _key((2,), {"F": 1}) != _key((2,), {"F": 1.0})
    assert _key((2,), {}) != _key((2, 2), {})
    # one flat tuple: the arguments' kinds and order still tell keys apart
    z = torch.zeros(8)
    assert _key((z, 2), {}) != _key((2, z), {})
    assert _key((None, 2.0), {}) != _key((2.0, None), {})
    assert _key((True, 2), {}) != _key((2, True), {})
    # a constexpr passed positionally is keyed by its value, not by its integer properties
    assert _key((2, 64), {}) == _key((2, 128), {})
    assert _key((2, 64), {}, frozenset({1})) != _key((2, 128), {}, frozenset({1}))


def test_tuples_are_keyed_by_their_elements() -> None:
    """Triton specializes each element of a tuple argument as an argument of its own."""
    base = torch.zeros(64)
    assert _key(((base, 2),), {}) == _key(((torch.zeros(8), 3),), {})
    assert _key(((base, 2),), {}) != _key(((base[1:], 2),), {})  # an element misaligned
    assert _key(((base, 2),), {}) != _key(((base, 16),), {})  # an element divisible by 16
    assert _key(((2, 2),), {}) != _key(((2, 2, 2),), {})  # the length
    assert _key(((2,), 2), {}) != _key(((2, 2),), {})  # where the tuple ends
    assert _key(((1.0, (base,)),), {}) == _key(((2.0, (base,)),), {})  # nested
    assert _key(((base, "text"),), {}) is None  # an element it cannot key
    # by keyword a tuple is never keyed: it may hold tensors, which a key would hold by
    # identity (a new entry, pinning them, at every call)
    assert _key((), {"X": (base,)}) is None
    assert _key((), {"X": (1, 2)}) is None


def test_keywords_never_read_as_positional_items() -> None:
    """A keyword named like a positional tag (``f``, ``b``) followed by its type and value must
    not give the key of a longer positional list (whose direct launch takes other arguments)."""
    t = torch.zeros(4)
    assert _key((t, 0.5, 1.0), {}, frozenset({2})) != _key((t,), {"f": 1.0}, frozenset({2}))
    assert _key((t, True, 4), {}, frozenset({2})) != _key((t,), {"b": 4}, frozenset({2}))


def test_key_refuses_what_it_cannot_key() -> None:
    assert _key(("text",), {}) is None
    assert _key((2,), {"T": torch.zeros(1)}) is None  # a tensor by keyword
    assert _key((2,), {"L": [1, 2]}) is None  # unhashable
    assert _key((2,), {"L": (1, [2])}) is None  # a tuple holding something unhashable


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_repeated_launches_equal_tritons_own_path(device, monkeypatch) -> None:
    assert isinstance(_add_relu, FastKernel)
    # a kernel of its own: the module's caches keys of earlier tests
    kernel = FastKernel(_add_relu.fn)
    monkeypatch.setattr(elementwise, "_add_relu", kernel)
    assert kernel._constexpr == frozenset({4})  # BLOCK
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(2 * 4096 + 7, generator=gen).to(device)
    other = torch.randn(2 * 4096 + 7, generator=gen).to(device)
    before = kernel.direct_launches
    # aligned, then misaligned views (another specialization), each launched three times
    for start in (0, 0, 0, 1, 1, 1, 4):
        x, y = base[start:], other[start:]
        got = add_relu_triton(x, y)
        z = x + y
        assert torch.equal(got, (z >= 0).to(z.dtype) * z)
    if device == "cuda":
        # two keys: aligned (starts 0 and 4: the element counts differ but are alike for
        # Triton) and misaligned (start 1); the first launch of each went through Triton
        assert kernel.direct_launches - before == 5 and len(kernel._compiled) == 2
    else:
        assert kernel.direct_launches == before  # the interpreter: always Triton's path
    # a callable grid is Triton's to evaluate: never launched directly
    x = base[:4096]
    kernel[lambda meta: (1,)](x, x, torch.empty_like(x), 4096, BLOCK=4096)
    kernel[lambda meta: (1,)](x, x, torch.empty_like(x), 4096, BLOCK=4096)
    assert kernel.direct_launches - before == (5 if device == "cuda" else 0)


@pytest.mark.skipif(not CUDA, reason="launch hooks are called by compiled launches only")
def test_a_launch_hook_sees_every_launch() -> None:
    from triton import knobs

    seen = []
    x = torch.randn(4096, device="cuda")
    add_relu_triton(x, x)  # compiled and keyed
    old = knobs.runtime.launch_enter_hook
    knobs.runtime.launch_enter_hook = lambda metadata: seen.append(1)
    try:
        before = _add_relu.direct_launches
        for _ in range(3):
            add_relu_triton(x, x)
        assert _add_relu.direct_launches == before
    finally:
        knobs.runtime.launch_enter_hook = old
    assert len(seen) == 3


def test_the_generated_keyers_equal_the_key() -> None:
    """Each call shape's generated key function gives `_key`'s key, for every kind of
    argument `_key` keys (aligned and misaligned tensors, integers at the specialization
    boundaries, constexprs by type and value, keywords), and falls back to `_key` where the
    shape has a type it keys otherwise."""
    base = torch.zeros(64)
    ints = [0, 1, 2, 16, 17, -1, (1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 1, 1 << 63]
    calls = [
        ((base, base[1:], 3, 2.5, None, True), {}, frozenset()),
        ((base[4:], 64, 128), {"BLOCK": 64, "FLAG": True}, frozenset({1})),
        ((base.to(torch.bfloat16), 2), {"F": 1.0, "G": None}, frozenset()),
        ((), {}, frozenset()),
        ((), {"BLOCK": 32}, frozenset()),
        ((2,), {"L": (1, 2)}, frozenset()),  # a keyword value `_key` checks for hashability
        ((2,), {"L": [1, 2]}, frozenset()),  # ... and refuses
        ((torch.nn.Parameter(base),), {}, frozenset()),  # a tensor subclass: `_key` per call
        (("text",), {}, frozenset()),  # refused
    ] + [((i, base), {"B": i}, frozenset()) for i in ints]
    for args, kwargs, constexpr in calls:
        keyer = launch._keyer(tuple(map(type, args)), tuple(kwargs), constexpr)
        want = _key(args, kwargs, constexpr)
        got = _key(args, kwargs, constexpr) if keyer is None else keyer(args, kwargs)
        assert got == want and (got is None) == (want is None), (args, kwargs)
        if want is not None:
            assert type(got) is tuple
    # the shapes of plain arguments get a generated function; a subclass does not
    assert launch._keyer((torch.Tensor, int), ("B",), frozenset()) is not None
    assert launch._keyer((torch.nn.Parameter,), (), frozenset()) is None


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_a_kernel_makes_one_keyer_per_call_shape(device, monkeypatch) -> None:
    kernel = FastKernel(_add_relu.fn)
    monkeypatch.setattr(elementwise, "_add_relu", kernel)
    base = torch.randn(4096 + 7).to(device)
    for start in (0, 0, 1, 4):  # aligned and misaligned views: one call shape, two keys
        x = base[start:]
        z = x + x
        assert torch.equal(add_relu_triton(x, x), (z >= 0).to(z.dtype) * z)
    assert len(kernel._keyers) == 1
    assert len(kernel._compiled) == 2  # aligned (starts 0 and 4) and misaligned (start 1)


@pytest.mark.skipif(not CUDA, reason="direct launches are of compiled kernels")
def test_tuple_arguments_are_launched_directly() -> None:
    """A kernel taking tuples (the running updates of several layers) is launched directly
    once its key was seen, with the tuples passed as Triton's own path passes them."""
    from mpsnn.ops.batch_norm import bn_running_update_portable
    from mpsnn.ops.batch_norm_params import RunningUpdate
    from mpsnn.ops.triton import batch_norm_vectors as vectors

    kernel = FastKernel(vectors._running_updates.fn)
    gen = torch.Generator().manual_seed(3)

    def updates() -> list[RunningUpdate]:
        out = []
        for c in (5, 64):
            t = [torch.rand(c, generator=gen).cuda() + 1 for _ in range(4)]
            out.append(RunningUpdate((t[0], t[1]), torch.tensor([9.0]).cuda(), t[2], t[3], 0.2))
        return out

    old = vectors._running_updates
    vectors._running_updates = kernel
    try:
        for _ in range(3):
            batch = updates()
            want = [(u.running[0].clone(), u.running[1].clone()) for u in batch]
            for u, w in zip(batch, want, strict=True):
                bn_running_update_portable(w, u.count, u.mean, u.m2, u.momentum)
            vectors.bn_running_updates_triton(batch)
            for u, w in zip(batch, want, strict=True):
                assert torch.equal(u.running[0], w[0]) and torch.equal(u.running[1], w[1])
    finally:
        vectors._running_updates = old
    assert kernel.direct_launches == 2 and len(kernel._compiled) == 1
