"""The Triton multi-tensor optimizer kernel against the portable path (on the CPU in
Triton's interpreter): the same float32 results for every rule and option, mixed gradient
dtypes, unaligned tensors; its chunk and address tables, their staging for a capture and the
caches around captures (simulated, so that this runs on the CPU too); and where the dispatch
picks the kernel."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

from mpsnn.core.capture import keeping_for_replays
from mpsnn.ops import optim, optim_hyper
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.optim_hyper import RegularizationType as Reg
from mpsnn.ops.optim_hyper import UpdateRule as Rule
from mpsnn.ops.triton import optim as triton_optim  # the dev setup installs Triton
from tests.helpers import TRITON_DEVICES, assert_close
from tests.ops._optim_helpers import _grads, _hyper, _option_id, _params, _run, _states

# ---------------------------------------------------------------------------------------------
# the Triton kernel: the same float32 results as the portable path

TRITON_SHAPES = [(1,), (3, 5), (2 * triton_optim.BLOCK + 3,), (0,), (4, 4, 3), (1000,)]
TRITON_GRADS = {
    "float32": [torch.float32] * 6,
    "mixed": [
        torch.float16,
        torch.float32,
        torch.bfloat16,
        torch.float32,
        torch.float32,
        torch.float16,
    ],
}


def _triton_update(rule, clip, reg):
    def update(v, g, r, s, h, st):
        tables = triton_optim.build_tables([v, g, r, *s])
        tables.launch(rule, h, st, clip, reg)

    return update


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("grads", list(TRITON_GRADS))
@pytest.mark.parametrize(
    ("clip", "reg"), [(False, Reg.NONE), (True, Reg.L1), (False, Reg.L2)], ids=_option_id
)
@pytest.mark.parametrize("rule", list(Rule), ids=lambda r: r.name)
def test_triton_update_equals_portable(rule, clip, reg, grads, device) -> None:
    dtypes = TRITON_GRADS[grads]
    runs = []
    for update in (None, _triton_update(rule, clip, reg)):
        values = _params(torch.float32, device, TRITON_SHAPES, seed=3)
        in_place = update is None or grads == "mixed"  # both placements for the kernel
        fast_paths.set_enabled(update is not None)  # the portable path also on CUDA
        try:
            runs.append(_run(rule, values, dtypes, 3, clip, reg, in_place, device, update))
        finally:
            fast_paths.set_enabled(True)
    (pw, ps, pstep), (tw, ts, tstep) = runs
    for i, shape in enumerate(TRITON_SHAPES):
        assert tw[i].shape == shape and tw[i].dtype == torch.float32
        assert_close(tw[i], pw[i], f"value {shape}", tol=2e-6)
        for j, name in enumerate(rule.state_names):
            assert_close(ts[j][i], ps[j][i], f"{name} {shape}", tol=2e-6)
    assert tstep.tolist() == pstep.tolist()  # one advance per update, over several launches
    if rule in (Rule.ADAM, Rule.ADAM_AMSGRAD):
        assert tstep.tolist() == [3, 0]


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_unaligned_tensors(device) -> None:
    # views one element into a buffer: contiguous but not 16-byte aligned (no vector accesses)
    buf = [torch.randn(n + 1, device=device) for n in (2 * triton_optim.BLOCK, 5)]
    grads = [torch.randn(n, device=device) for n in (2 * triton_optim.BLOCK, 5)]
    runs = []
    for use_triton in (False, True):
        values = [b.clone()[1:] for b in buf]
        states = _states(Rule.ADAM, values)
        hyper, step = _hyper(Rule.ADAM, device, 0.1), optim_hyper.make_step(device)
        if use_triton:
            tables = triton_optim.build_tables([values, grads, values, *states])
            assert not tables.aligned
            tables.launch(Rule.ADAM, hyper, step, False, Reg.NONE)
        else:
            fast_paths.set_enabled(False)
            try:
                optim.adam_update(values, grads, values, *states, None, hyper, step)
            finally:
                fast_paths.set_enabled(True)
        runs.append(values + states[0] + states[1])
    for i, (a, b) in enumerate(zip(*runs, strict=True)):
        assert_close(a, b, f"tensor {i}", tol=2e-6)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_tables(device) -> None:
    n = triton_optim.BLOCK
    v = [torch.zeros(s, device=device) for s in ((2 * n + 1,), (0,), (5,))]
    g = [torch.zeros_like(v[0]).half(), torch.zeros_like(v[1]), torch.zeros_like(v[2])]
    t = triton_optim.build_tables([v, g, v])
    assert t.ptrs.shape == (3, 3) and t.ptrs[0, 1].item() == g[0].data_ptr()
    (c16, n16, _), (c32, n32, _) = t.groups  # one chunk table per gradient dtype
    assert (n16, n32) == (3, 1)
    assert c16.tolist() == [[0, 0, n], [0, n, 2 * n], [0, 2 * n, 2 * n + 1]]
    assert c32.tolist() == [[2, 0, 5]]  # the empty tensor has no chunk
    assert triton_optim.build_tables([v[1:2], g[1:2], v[1:2]]) is None


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_tables_staged_for_a_capture(device, monkeypatch) -> None:
    """The tables built for a capture hold what the eager ones hold and give the same bits.
    They are staged through host buffers (pinned on CUDA), copied without waiting, and kept out
    of the shared chunk cache; nothing but the caller holds them. ``capturing=True`` forces
    that route here: on CUDA nothing is captured, and on the CPU nothing can be (the buffers
    are not pinned)."""
    monkeypatch.setattr(triton_optim, "_CHUNKS", type(triton_optim._CHUNKS)())
    n = triton_optim.BLOCK
    shapes = [(2 * n + 1,), (0,), (5,), (3, 4)]
    dtypes = [torch.float16, torch.float32, torch.float32, torch.bfloat16]  # 3 chunk tables
    values = _params(torch.float32, device, shapes, seed=9)
    grads = _grads(2, dtypes, device, shapes)
    states = _states(Rule.ADAM, values)
    lists = [values, grads, values, *states]

    staged = triton_optim.build_tables(lists, capturing=True)  # no chunk table cached yet
    assert len(triton_optim._CHUNKS) == 0  # built for that capture alone
    eager = triton_optim.build_tables(lists, capturing=False)
    assert len(triton_optim._CHUNKS) == 1 and eager.staged == ()
    again = triton_optim.build_tables(lists, capturing=True)  # the cached chunk tables
    assert again.groups is eager.groups and len(again.staged) == 1  # only addresses staged
    for t in (staged, again):
        assert t.ptrs.device == eager.ptrs.device and torch.equal(t.ptrs, eager.ptrs)
        assert t.aligned == eager.aligned and len(t.groups) == len(eager.groups) == 3
        for (c, k, dt), (ce, ke, dte) in zip(t.groups, eager.groups, strict=True):
            assert torch.equal(c, ce) and (k, dt) == (ke, dte)
    # the staged buffers: host memory holding what the device tables received, not aliased
    copies = [*(c for c, _, _ in staged.groups), staged.ptrs]
    assert len(staged.staged) == len(copies)
    for buf, table in zip(staged.staged, copies, strict=True):
        assert buf.device.type == "cpu" and buf.is_pinned() == (device == "cuda")
        assert buf.data_ptr() != table.data_ptr() and torch.equal(buf, table.cpu())
    gone = weakref.ref(staged), weakref.ref(again)  # their only owner is this test

    w0 = [v.clone() for v in values]
    hyper = _hyper(Rule.ADAM, device, 0.1)
    runs = []
    for t in (eager, staged, again):  # the same update of the same tensors, three times
        for v, x in zip(values, w0, strict=True):
            v.copy_(x)
        for s in states:
            for x in s:
                x.zero_()
        step = optim_hyper.make_step(device)
        for _ in range(2):
            t.launch(Rule.ADAM, hyper, step, True, Reg.L1)
        runs.append([x.clone() for x in (*values, *states[0], *states[1], step)])
    for run in runs[1:]:
        for i, (a, b) in enumerate(zip(run, runs[0], strict=True)):
            assert torch.equal(a, b), f"tensor {i}"
    del t, staged, again, copies, buf, table
    gc.collect()
    assert [ref() for ref in gone] == [None, None]


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_tables_first_seen_in_a_capture_are_not_cached(device, monkeypatch) -> None:
    """`apply_update`'s cache around captures, which are simulated here by replacing the
    capture status and the dispatch, so that this also runs on the CPU. Tables built during a
    capture are used without a warning, handed to the capture being recorded, and not cached.
    A cached table used during a capture is handed to it too. All of them update the same
    bits."""
    plans = optim.UpdatePlans()
    capturing = [True]
    monkeypatch.setattr(optim, "_capturing", lambda hyper: capturing[0])
    built = []

    def dispatch(lists, capturing=None):
        built.append(capturing)
        return triton_optim.build_tables(lists, capturing)

    monkeypatch.setattr(fast_paths, "optimizer_tables", dispatch)
    shapes = [(3, 5), (triton_optim.BLOCK + 7,)]
    values = _params(torch.float32, device, shapes, seed=4)
    grads = _grads(1, [torch.float32, torch.float16], device, shapes)
    (momenta,) = _states(Rule.SGD_MOMENTUM, values)
    hyper = _hyper(Rule.SGD_MOMENTUM, device, 0.05)
    ref_values = [v.clone() for v in values]
    ref_momenta = [m.clone() for m in momenta]
    ref = triton_optim.build_tables([ref_values, grads, ref_values, ref_momenta], False)

    def update() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            optim.sgd_update(values, grads, values, momenta, hyper, plans=plans)
        ref.launch(Rule.SGD_MOMENTUM, hyper, None, False, Reg.NONE)

    with keeping_for_replays() as kept:
        update()  # first seen during a capture: this capture's own tables
    assert built == [True] and len(plans) == 0 and len(kept) == 1
    capturing[0] = False
    update()  # outside: built again, eagerly, and cached
    assert built == [True, False] and len(plans) == 1 and len(kept) == 1
    update()  # cached
    assert built == [True, False] and len(kept) == 1
    capturing[0] = True
    with keeping_for_replays() as later:
        update()  # cached, used by a capture: kept by that capture too
    assert built == [True, False] and len(kept) == 1 and len(later) == 1
    ((_, cached_plan),) = plans._plans.values()
    assert later[0] is cached_plan and kept[0] is not cached_plan
    for a, b in zip([*values, *momenta], [*ref_values, *ref_momenta], strict=True):
        assert torch.equal(a, b)


def test_dispatch_picks_triton_only_where_it_applies() -> None:
    cpu = [[torch.zeros(4)] for _ in range(3)]
    assert fast_paths.optimizer_tables(cpu) is None  # CPU tensors run the portable path
    if torch.cuda.is_available():
        gpu = [[torch.zeros(4, device="cuda")] for _ in range(3)]
        assert fast_paths.optimizer_tables(gpu) is not None
        half = [gpu[0], [gpu[1][0].half()], gpu[2]]
        assert fast_paths.optimizer_tables(half) is not None
        f64 = [[t.double() for t in lst] for lst in gpu]
        assert fast_paths.optimizer_tables(f64) is None
        strided = [[torch.zeros(4, 2, device="cuda")[:, 0]], gpu[1], gpu[2]]
        assert fast_paths.optimizer_tables(strided) is None
        fast_paths.set_enabled(False)
        try:
            assert fast_paths.optimizer_tables(gpu) is None
        finally:
            fast_paths.set_enabled(True)
