"""Adam and AMSGrad on CPU float32 lists through PyTorch's fused kernel
(`mpsnn.ops.optim_portable.cpu_fused_adam`): it runs exactly where it applies, computes MPS's update
(``eps`` rescaled to PyTorch's placement) as accurately as the portable path against the
float64 formulas, over every option and a changing, once negative, learning rate, and leaves
what it does not take (float64, ``beta2 = 1``) to the portable path. A parameter's bits follow
the memory order of its storage (contiguous, or channels-last within a vector tail's roundings),
never the gradient's layout."""

from __future__ import annotations

import pytest
import torch

from mpsnn.ops import optim, optim_hyper, optim_portable
from mpsnn.ops.optim_hyper import UpdateRule as Rule
from tests.ops._optim_helpers import OPTIONS, SHAPES, _option_id, _params, _reference, _run

ADAMS = [Rule.ADAM, Rule.ADAM_AMSGRAD]


def _spy(monkeypatch) -> list[int]:
    """Counts the fused kernel's calls."""
    calls: list[int] = []
    real = optim_portable._FUSED_ADAM
    assert real is not None, "this PyTorch has torch._fused_adam_"

    def fused(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(optim_portable, "_FUSED_ADAM", fused)
    return calls


def _max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(
        ((g.double() - w).abs() / (w.abs() + 1e-3)).max().item()
        for g, w in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "out-of-place"])
@pytest.mark.parametrize(("clip", "reg"), OPTIONS, ids=_option_id)
@pytest.mark.parametrize("rule", ADAMS, ids=lambda r: r.name)
def test_the_fused_kernel_is_as_accurate_as_the_portable_path(
    rule, clip, reg, in_place, monkeypatch
) -> None:
    steps = 6
    dtypes = [torch.float32] * len(SHAPES)
    want_w, want_s = _reference(rule, _params(torch.float64), dtypes, steps, clip, reg)
    calls = _spy(monkeypatch)
    got_w, got_s, step = _run(rule, _params(torch.float32), dtypes, steps, clip, reg, in_place)
    assert calls == [len(SHAPES)] * steps  # one fused call per update, over the whole list
    assert step.tolist() == [steps, 0]
    monkeypatch.setattr(optim_portable, "_FUSED_ADAM", None)  # the portable path, for comparison
    old_w, old_s, _ = _run(rule, _params(torch.float32), dtypes, steps, clip, reg, in_place)
    # against the float64 formulas: within float32 accuracy, and not worse than the portable
    # path's own float32 error beyond a few roundings
    for got, old, want in [(got_w, old_w, want_w)] + [
        (got_s[j], old_s[j], want_s[j]) for j in range(len(rule.state_names))
    ]:
        err, old_err = _max_error(got, want), _max_error(old, want)
        assert err < 2e-5, err
        assert err <= 4 * old_err + 1e-6, (err, old_err)


def test_what_the_fused_kernel_does_not_take_runs_the_portable_path(monkeypatch) -> None:
    calls = _spy(monkeypatch)
    dtypes64 = [torch.float64] * len(SHAPES)
    # float64 values: the portable path, the formulas to 1e-12
    got, _, _ = _run(Rule.ADAM, _params(torch.float64), dtypes64, 3, False, 0, True)
    want, _ = _reference(Rule.ADAM, _params(torch.float64), dtypes64, 3, False, 0)
    assert calls == [] and _max_error(got, want) < 1e-12
    # beta2 = 1: lr_t divides by zero; the portable path's arithmetic (inf / NaN), not a
    # fused kernel with an infinite eps
    w, g = torch.randn(5), torch.randn(5)
    m, v = optim_hyper.init_state(Rule.ADAM, w)
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.1, beta2=1.0)
    step = optim_hyper.make_step("cpu")
    optim.adam_update([w], [g], [w], [m], [v], None, hyper, step)
    assert calls == [] and step.tolist() == [1, 0] and not torch.isfinite(w).all()


def _updated(rule, w: torch.Tensor, states, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``w`` and its state after one update per gradient, in place; their bits."""
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.01, momentum_scale=0.9, beta2=0.99)
    step = optim_hyper.make_step("cpu")
    held = w
    for g in grads:
        optim.apply_update(rule, [w], [g], [w], states, hyper, step)
    assert w is held  # updated in place
    return [t.contiguous().view(torch.int32) for t in (w, *(s[0] for s in states))]


@pytest.mark.parametrize("rule", ADAMS, ids=lambda r: r.name)
def test_a_gradients_layout_does_not_change_the_bits(rule, monkeypatch) -> None:
    """A channels-last parameter and state (a weights state's OIHW view of OHWI storage, as a
    data source that holds MPS's OHWI weights gives them) are updated in place through NHWC
    views of them whatever the gradient's layout: a contiguous gradient is copied
    channels-last (it is only read), so it gives the bits a channels-last one gives, and no
    written tensor is copied."""
    real = optim_portable._FUSED_ADAM
    seen: list[torch.Tensor] = []

    def fused(*args, **kwargs):
        seen.append(args[0][0])
        return real(*args, **kwargs)

    monkeypatch.setattr(optim_portable, "_FUSED_ADAM", fused)
    gen = torch.Generator().manual_seed(7)
    ohwi = torch.randn(5, 3, 3, 4, generator=gen)  # 180 values: a vector tail in either order
    grads = [torch.randn(5, 4, 3, 3, generator=gen) for _ in range(4)]  # OIHW, contiguous
    runs = []
    for grad_fmt in (torch.contiguous_format, torch.channels_last):
        w = ohwi.permute(0, 3, 1, 2).clone(memory_format=torch.preserve_format)  # OIHW view
        states = [list(x) for x in zip(optim_hyper.init_state(rule, w), strict=True)]
        assert all(s[0].stride() == w.stride() for s in states) and not w.is_contiguous()
        seen.clear()
        runs.append(
            _updated(rule, w, states, [g.contiguous(memory_format=grad_fmt) for g in grads])
        )
        assert all(v._base is w and v.is_contiguous() for v in seen)  # views of w: no copy
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rule", ADAMS, ids=lambda r: r.name)
def test_other_layouts_are_updated_through_contiguous_copies(rule) -> None:
    """A parameter in a layout that is neither contiguous nor channels-last (here OIHW values
    in (I, O, H, W) memory) is updated through contiguous copies, written back in place: the
    bits of the contiguous parameter."""
    gen = torch.Generator().manual_seed(9)
    w0 = torch.randn(5, 4, 3, 3, generator=gen)
    grads = [torch.randn(w0.shape, generator=gen) for _ in range(4)]
    runs = []
    for dense in (True, False):
        w = w0.clone() if dense else w0.transpose(0, 1).contiguous().transpose(0, 1)
        states = [list(x) for x in zip(optim_hyper.init_state(rule, w), strict=True)]
        if not dense:
            states = [[s.transpose(0, 1).contiguous().transpose(0, 1)] for [s] in states]
            assert not w.is_contiguous() and not w.is_contiguous(memory_format=torch.channels_last)
        runs.append(_updated(rule, w, states, grads))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rule", ADAMS, ids=lambda r: r.name)
def test_the_fused_update_stays_within_roundings_of_the_portable_one(rule, monkeypatch) -> None:
    """The kernel reads the portable path's float32 betas: after six updates the weights and
    the second moments (AMSGrad's maximum too) are within a few float32 roundings of the
    portable path's, with some results written out of place and some in place in one list
    (with float64 betas ``v`` drifted by about 1.3e-5 relative per update)."""
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(optim_portable, "_FUSED_ADAM", None)
        gen = torch.Generator().manual_seed(0)
        values = [torch.randn(1000, generator=gen), torch.randn(7, 3, generator=gen)]
        states = [
            list(x) for x in zip(*(optim_hyper.init_state(rule, v) for v in values), strict=True)
        ]
        hyper = optim_hyper.make_hyper(
            "cpu", learning_rate=1e-3, momentum_scale=0.9, beta2=0.999, epsilon=1e-8
        )
        step = optim_hyper.make_step("cpu")
        for k in range(6):
            grads = [torch.randn(v.shape, generator=gen) * (0.1 if k % 2 else 1.0) for v in values]
            results = [values[0], torch.empty_like(values[1])]  # in place, out of place
            optim.apply_update(rule, values, grads, results, states, hyper, step)
            values = results
        runs.append((values, states))
    (w_fused, s_fused), (w_port, s_port) = runs
    for j in range(1, len(s_fused)):  # v, vmax
        for a, b in zip(s_fused[j], s_port[j], strict=True):
            assert torch.allclose(a, b, rtol=1e-6, atol=0)
    for a, b in zip(w_fused, w_port, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rule", ADAMS, ids=lambda r: r.name)
def test_channels_last_parameters_are_updated_through_views(rule, monkeypatch) -> None:
    """A parameter whose value, gradient and state are all channels-last (a CPU float32
    convolution's) reaches the kernel as contiguous NHWC views of them, no copy. The update is
    element-wise, but the kernel's scalar tail (the last elements in memory order) may round
    one unit in the last place apart from its vector body, and the order puts other elements
    there: the contiguous layout's values within two units in the last place."""
    real = optim_portable._FUSED_ADAM
    seen: list[list[torch.Tensor]] = []

    def fused(*args, **kwargs):
        seen.append(list(args[0]) + list(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(optim_portable, "_FUSED_ADAM", fused)
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(7, 5, 3, 3, generator=gen)  # odd sizes: vector tails differ by order
    grads = [torch.randn(w0.shape, generator=gen) for _ in range(4)]
    runs = []
    for cl in (False, True):
        fmt = torch.channels_last if cl else torch.contiguous_format
        w = w0.clone(memory_format=fmt)
        states = [list(x) for x in zip(optim_hyper.init_state(rule, w), strict=True)]
        assert all(s[0].stride() == w.stride() for s in states)
        hyper = optim_hyper.make_hyper("cpu", learning_rate=0.01, beta2=0.99)
        step = optim_hyper.make_step("cpu")
        for g in grads:
            optim.apply_update(rule, [w], [g.contiguous(memory_format=fmt)], [w], states, hyper,
                               step)  # fmt: skip
        if cl:  # the kernel wrote w through a view of it
            value, grad = seen[-1]
            assert value._base is w and value.is_contiguous() and grad.is_contiguous()
        runs.append([w.clone(), *(s[0].clone() for s in states)])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(b, a, rtol=2**-22, atol=0.0)
        assert (a != b).sum() <= 16  # at most a tail's worth of elements
