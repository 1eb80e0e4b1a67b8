"""The whole optimizer dispatch on CUDA at a larger size, and CUDA-graph capture of the
updates: a captured update follows the learning rate and advances Adam's step on the device at
every replay; gradients allocated inside the captured region run the Triton update, replayed
with new values to the bits of the eager path; the tables a graph needs are kept by the capture
(not freed when evicted from the caches or when their owner dies) and freed with it, also
staged with pinned copies pending. The first test also runs on the CPU (the step and learning
rate read from their tensors at each update); tests/ops/test_optim_table_lifetime.py checks
the lifetimes on the CPU."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

from mpsnn.core.capture import keep_for_replays, keeping_for_replays
from mpsnn.ops import optim, optim_hyper
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.optim_hyper import RegularizationType as Reg
from mpsnn.ops.optim_hyper import UpdateRule as Rule
from mpsnn.ops.triton import optim as triton_optim  # the dev setup installs Triton
from tests.helpers import assert_close
from tests.ops._optim_helpers import (
    LRS,
    _grads,
    _hyper,
    _params,
    _ref_params,
    _run,
    _states,
    ref_gradient,
    ref_update,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


# ---------------------------------------------------------------------------------------------
# CUDA only: the whole dispatch at a larger size, and CUDA-graph capture


def test_cuda_update_and_graph_capture(monkeypatch) -> None:
    """On the CPU: an update reads learning rate and step from their tensors each time (what a
    captured graph relies on). On CUDA also: the dispatched Triton update equals the portable
    one over a million-element list, and a captured Adam update follows the learning rate and
    advances the step at every replay."""
    w = [torch.randn(6)]
    m, v = [torch.zeros(6)], [torch.zeros(6)]
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.1, beta1=0.9, beta2=0.99, epsilon=1e-3)
    step = optim_hyper.make_step("cpu")
    g = [torch.ones(6)]
    optim.adam_update(w, g, w, m, v, None, hyper, step)
    w1 = w[0].clone()
    optim_hyper.set_hyper(hyper, learning_rate=0.0)
    optim.adam_update(w, g, w, m, v, None, hyper, step)
    assert torch.equal(w[0], w1) and step.tolist() == [2, 0]
    if not torch.cuda.is_available():
        return
    shapes = [(64, 3, 7, 7), (64,), (512, 512, 3, 3), (1000, 512), (1000,), (1,)]
    for rule in (Rule.ADAM, Rule.SGD_NESTEROV, Rule.RMSPROP):
        runs = []
        for enabled in (False, True):
            fast_paths.set_enabled(enabled)
            try:
                values = _params(torch.float32, "cuda", shapes, seed=5)
                runs.append(_run(rule, values, [torch.float32] * 6, 5, True, Reg.L1, True, "cuda"))
            finally:
                fast_paths.set_enabled(True)
        (pw, ps, pstep), (tw, ts, tstep) = runs
        for i in range(len(shapes)):
            assert_close(tw[i], pw[i], f"{rule.name} value {i}", tol=2e-6)
            for j in range(len(rule.state_names)):
                assert_close(ts[j][i], ps[j][i], f"{rule.name} state {j} {i}", tol=2e-6)
        assert tstep.tolist() == pstep.tolist()

    # capture (the Triton path, then the portable one): warm up on a side stream, capture one
    # AMSGrad update with clipping, replay it with new learning rates. The graph records the
    # cached tables of the warm-up; evicting them from the caches must not free them.
    for enabled in (True, False):
        fast_paths.set_enabled(enabled)
        try:
            _capture_and_replay(shapes[:3], monkeypatch)
        finally:
            fast_paths.set_enabled(True)


def _own_caches(monkeypatch) -> optim.UpdatePlans:
    """An empty shared chunk cache, owned by this test, and a new owner of update tables."""
    monkeypatch.setattr(triton_optim, "_CHUNKS", type(triton_optim._CHUNKS)())
    return optim.UpdatePlans()


def _drop_caches(plans: optim.UpdatePlans) -> list[torch.Tensor]:
    """Evict everything from the table caches (the test's own: `_own_caches`) and collect.
    Then fill freshly allocated device memory with -1. Had a graph's tables been freed with
    their cache entries, that memory would now hold -1 "addresses". Returns the filler; keep
    it until the replays are done."""
    plans.clear()
    triton_optim._CHUNKS.clear()
    gc.collect()
    return [torch.full((n,), -1, dtype=torch.int64, device="cuda") for n in (4, 16, 64, 512, 4096)]


def _capture_and_replay(shapes, monkeypatch) -> None:
    plans = _own_caches(monkeypatch)
    rule = Rule.ADAM_AMSGRAD
    values = _params(torch.float32, "cuda", shapes, seed=6)
    grads = [torch.randn_like(x) for x in values]
    ref = [x.double().cpu() for x in values]
    ref_state = [[torch.zeros_like(x) for _ in range(3)] for x in ref]
    states = _states(rule, values)
    hyper = _hyper(rule, "cuda", 0.01)
    step = optim_hyper.make_step("cuda")

    def update() -> None:
        optim.apply_update(rule, values, grads, values, states, hyper, step, clip=True,
                           plans=plans)  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        update()  # warm-up: checks, tables, compilation
    torch.cuda.current_stream().wait_stream(side)
    p = _ref_params(rule, 0.01)
    for i, x in enumerate(ref):
        g = ref_gradient(x, grads[i].double().cpu(), p, True, Reg.NONE)
        ref[i] = ref_update(rule, x, g, ref_state[i], p, 1)
    graph = torch.cuda.CUDAGraph()
    with keeping_for_replays() as kept, torch.cuda.graph(graph):
        update()
    assert len(kept) == (1 if fast_paths.enabled() else 0)  # the cached tables it recorded
    filler = _drop_caches(plans)
    for k, lr in enumerate([0.02, -0.01, 0.005]):
        optim_hyper.set_hyper(hyper, learning_rate=lr)
        graph.replay()
        p = _ref_params(rule, lr)
        for i, x in enumerate(ref):
            g = ref_gradient(x, grads[i].double().cpu(), p, True, Reg.NONE)
            ref[i] = ref_update(rule, x, g, ref_state[i], p, k + 2)
    torch.cuda.synchronize()
    assert all((f == -1).all() for f in filler)
    assert step.tolist() == [4, 0]  # the replays advanced the step on the device
    for i in range(len(shapes)):
        assert_close(values[i], ref[i], f"replayed value {i}", tol=2e-5)


# the gradients of a compiled training step: allocated inside the capture, refilled in place
GRAPH_SHAPES = [(64, 3, 7, 7), (64,), (2 * triton_optim.BLOCK + 3,), (1,), (1000, 17)]
GRAPH_GRADS = [torch.float32, torch.float16, torch.float32, torch.bfloat16, torch.float32]


@needs_cuda
@pytest.mark.parametrize(
    ("rule", "chunks", "mode"),
    [
        (Rule.ADAM_AMSGRAD, "cached", "thread_local"),  # as `CommandBuffer.capture`
        (Rule.ADAM, "built in the capture", "global"),  # torch.cuda.graph's default
        (Rule.SGD_NESTEROV, "cached", "global"),
        (Rule.RMSPROP, "built in the capture", "thread_local"),
    ],
    ids=lambda x: x.name if isinstance(x, Rule) else str(x).replace(" ", "-"),
)
def test_cuda_graph_with_gradients_allocated_in_the_capture(rule, chunks, mode, monkeypatch):
    """A captured update whose gradients are allocated inside the captured region (first seen
    there) runs the Triton update, with no warning. Replayed with new gradient values written
    in place, it gives the bits of the eager Triton path over the same sequence. The chunk
    tables come from the cache, or are built in the capture when the cache lacks them. After
    the capture the caches are emptied: the graph needs nothing from them."""
    steps, clip, reg = 4, True, Reg.L2
    sources = [_grads(k, GRAPH_GRADS, "cuda", GRAPH_SHAPES, seed=300) for k in range(steps)]
    plans = _own_caches(monkeypatch)

    def fresh():
        values = _params(torch.float32, "cuda", GRAPH_SHAPES, seed=8)
        hyper = _hyper(rule, "cuda", LRS[0])
        return values, _states(rule, values), hyper, optim_hyper.make_step("cuda")

    def update(values, grads, states, hyper, step):
        optim.apply_update(rule, values, grads, values, states, hyper, step,
                           clip=clip, regularization=reg, plans=plans)  # fmt: skip

    # the eager Triton path; it also compiles every kernel variant the capture launches
    eager = fresh()
    for k in range(steps):
        optim_hyper.set_hyper(eager[2], learning_rate=LRS[k])
        update(eager[0], sources[k], *eager[1:])
    assert len(plans) == steps and all(plan for _, plan in plans._plans.values())
    assert len(triton_optim._CHUNKS) == 1
    if chunks != "cached":
        triton_optim._CHUNKS.clear()

    values, states, hyper, step = fresh()
    grads: list[torch.Tensor] = []
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with keeping_for_replays() as held, torch.cuda.graph(graph, capture_error_mode=mode):
            grads += [
                torch.empty(s, dtype=dt, device="cuda")
                for s, dt in zip(GRAPH_SHAPES, GRAPH_GRADS, strict=True)
            ]
            update(values, grads, states, hyper, step)
    assert len(plans) == steps  # the capture's tables are not cached
    (kept,) = held  # but kept by the capture
    assert len(kept.staged) == (1 if chunks == "cached" else 1 + len(kept.groups))
    assert all(t.is_pinned() for t in kept.staged)
    assert len(triton_optim._CHUNKS) == (1 if chunks == "cached" else 0)
    gone = weakref.ref(kept)
    del kept
    filler = _drop_caches(plans)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(steps):
            for g, src in zip(grads, sources[k], strict=True):
                g.copy_(src)  # new gradient values, in place
            optim_hyper.set_hyper(hyper, learning_rate=LRS[k])
            graph.replay()
    torch.cuda.synchronize()
    assert all((f == -1).all() for f in filler)
    got = [*values, *(x for s in states for x in s), step]
    want = [*eager[0], *(x for s in eager[1] for x in s), eager[3]]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"tensor {i} differs from the eager Triton path"
    if rule in (Rule.ADAM, Rule.ADAM_AMSGRAD):
        assert step.tolist() == [steps, 0]
    assert gone() is not None  # alive while the capture's list is
    del held, graph
    gc.collect()
    assert gone() is None  # freed with it


@needs_cuda
def test_cuda_graph_tables_staged_with_pinned_copies_pending(monkeypatch) -> None:
    """The staging works even when PyTorch's pinned-memory allocator has events left to
    process: a pinned buffer freed after a non-blocking copy leaves one, as a data loader
    with pinned memory does. Allocating a pinned buffer inside the capture must not query
    that event. `build_tables` called directly inside a capture works too, its caller handing
    the result to the capture."""
    plans = _own_caches(monkeypatch)
    hyper = optim_hyper.make_hyper("cuda", learning_rate=0.5)
    warm = [[torch.zeros(8, device="cuda")] for _ in range(3)]
    optim.sgd_update(*warm, None, hyper, plans=plans)  # compiles the kernel (SGD, float32)
    host = torch.ones(1 << 16, pin_memory=True)
    torch.empty(1 << 16, device="cuda").copy_(host, non_blocking=True)
    del host  # freed with its copy's event recorded, processed by a later pinned allocation
    fresh = [torch.zeros(8, device="cuda")]
    other = [torch.zeros(8, device="cuda")]
    ones = [torch.ones(8, device="cuda")]
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with (
            keeping_for_replays() as kept,
            torch.cuda.graph(graph, capture_error_mode="thread_local"),
        ):
            optim.sgd_update(fresh, ones, fresh, None, hyper, plans=plans)
            tables = triton_optim.build_tables([other, ones, other])
            assert keep_for_replays(tables)
            tables.launch(Rule.SGD, hyper, None, False, Reg.NONE)
    assert len(kept) == 2 and len(plans) == 1  # the warm-up's
    del tables
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert fresh[0].tolist() == [-1.0] * 8 and other[0].tolist() == [-1.0] * 8


@needs_cuda
def test_a_captured_buffer_keeps_the_tables_it_recorded_and_frees_them_with_it() -> None:
    """`CommandBuffer.capture` of an optimizer's update: the captured buffer holds the tables
    its graph reads (staged for the capture: the capture's stream is not the one the
    optimizer's cached tables were made on), also once the optimizer is gone, and they are
    freed with the captured buffer."""
    import mpsnn as m
    from mpsnn.ops.triton.optim import MultiTensorTables

    dev = m.Device("cuda")
    q = dev.new_command_queue()
    opt = m.SGD(dev, descriptor=m.OptimizerDescriptor(learning_rate=0.5))
    w, g = torch.zeros(8, device="cuda"), torch.ones(8, device="cuda")

    vectors = dict(input_gradient_vector=g, input_values_vector=w, result_values_vector=w)
    cb = q.command_buffer()
    opt.encode(cb, **vectors)  # warm-up: compiles the kernel, caches tables in `opt`
    cb.commit()
    cb.wait_until_completed()
    cb = q.command_buffer()
    opt.encode(cb, **vectors)
    captured = cb.capture()  # recorded, not run
    kept = [t for t in captured._keep_alive if isinstance(t, MultiTensorTables)]
    assert len(kept) == 1
    gone = weakref.ref(kept[0])
    del kept
    opt._plans.clear()
    del opt, cb
    gc.collect()
    assert gone() is not None  # the capture keeps them
    for _ in range(2):
        captured.replay()
    captured.wait_until_completed()
    assert w.tolist() == [-1.5] * 8  # the warm-up and two replays
    del captured
    gc.collect()
    assert gone() is None


@needs_cuda
def test_a_capture_of_your_own_must_keep_the_tables(monkeypatch) -> None:
    """A ``torch.cuda.graph`` capture that records a Triton update outside any
    `keeping_for_replays` scope is refused: nothing would keep the tables its graph reads."""
    plans = _own_caches(monkeypatch)
    hyper = optim_hyper.make_hyper("cuda", learning_rate=0.5)
    w, g = [torch.zeros(8, device="cuda")], [torch.ones(8, device="cuda")]
    optim.sgd_update(w, g, w, None, hyper, plans=plans)  # compiles the kernel
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.raises(ValueError, match=r"\[apply_update\] a CUDA graph that records"),
        torch.cuda.graph(graph, capture_error_mode="thread_local"),
    ):
        optim.sgd_update(w, g, w, None, hyper, plans=plans)
