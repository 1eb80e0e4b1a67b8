"""Adam and AMSGrad on CPU float32 lists through PyTorch's fused kernel
(`mpsnn.ops.optim._cpu_fused_adam`): it runs exactly where it applies, computes MPS's update
(``eps`` rescaled to PyTorch's placement) as accurately as the portable path against the
float64 formulas, over every option and a changing, once negative, learning rate, and leaves
what it does not take (float64, non-contiguous tensors, ``beta2 = 1``) to the portable path."""

from __future__ import annotations

import pytest
import torch

from mpsnn.ops import optim, optim_hyper
from mpsnn.ops.optim_hyper import UpdateRule as Rule
from tests.ops._optim_helpers import OPTIONS, SHAPES, _option_id, _params, _reference, _run

ADAMS = [Rule.ADAM, Rule.ADAM_AMSGRAD]


def _spy(monkeypatch) -> list[int]:
    """Counts the fused kernel's calls."""
    calls: list[int] = []
    real = optim._FUSED_ADAM
    assert real is not None, "this PyTorch has torch._fused_adam_"

    def fused(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(optim, "_FUSED_ADAM", fused)
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
    monkeypatch.setattr(optim, "_FUSED_ADAM", None)  # the portable path, for comparison
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
    # a non-contiguous value
    w = torch.randn(6, 4).t()
    g = torch.randn(4, 6)
    m, v = optim_hyper.init_state(Rule.ADAM, torch.empty(4, 6))
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.1)
    optim.adam_update([w], [g], [w], [m], [v], None, hyper, optim_hyper.make_step("cpu"))
    assert calls == []
    # beta2 = 1: lr_t divides by zero; the portable path's arithmetic (inf / NaN), not a
    # fused kernel with an infinite eps
    w, g = torch.randn(5), torch.randn(5)
    m, v = optim_hyper.init_state(Rule.ADAM, w)
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.1, beta2=1.0)
    step = optim_hyper.make_step("cpu")
    optim.adam_update([w], [g], [w], [m], [v], None, hyper, step)
    assert calls == [] and step.tolist() == [1, 0] and not torch.isfinite(w).all()
