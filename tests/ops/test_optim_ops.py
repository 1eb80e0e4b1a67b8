"""MPS's optimizer updates (SGD, RMSProp, Adam) on the portable path: against their formulas
written out in float64 (`_optim_helpers`), against torch.optim where the formulas coincide (and
where they do not, the exact relation). Hyperparameters and Adam's step live in device memory:
an update follows `set_hyper` without being rebuilt. The Triton kernel is in
`test_optim_triton`, CUDA-graph capture in `test_optim_cuda_graphs`."""

from __future__ import annotations

import math

import pytest
import torch

from mpsnn.ops import optim, optim_hyper
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.optim_hyper import Hyper
from mpsnn.ops.optim_hyper import RegularizationType as Reg
from mpsnn.ops.optim_hyper import UpdateRule as Rule
from tests.helpers import assert_close
from tests.ops._optim_helpers import (
    LRS,
    OPTIONS,
    SHAPES,
    _grads,
    _hyper,
    _option_id,
    _params,
    _reference,
    _run,
    _states,
)

# ---------------------------------------------------------------------------------------------
# the formulas


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "out-of-place"])
@pytest.mark.parametrize(("clip", "reg"), OPTIONS, ids=_option_id)
@pytest.mark.parametrize("rule", list(Rule), ids=lambda r: r.name)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_update_follows_the_formulas(rule, clip, reg, in_place, dtype) -> None:
    steps = 6
    values = _params(dtype)
    want_w, want_s = _reference(rule, values, [dtype] * len(SHAPES), steps, clip, reg)
    got_w, got_s, step = _run(rule, values, [dtype] * len(SHAPES), steps, clip, reg, in_place)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for i in range(len(SHAPES)):
        assert got_w[i].dtype == dtype
        assert_close(got_w[i], want_w[i], f"{rule.name} value {i}", tol=tol)
        for j, name in enumerate(rule.state_names):
            assert_close(got_s[j][i], want_s[j][i], f"{rule.name} {name} {i}", tol=tol)
    if rule in (Rule.ADAM, Rule.ADAM_AMSGRAD):
        assert step.tolist() == [steps, 0]
    if rule == Rule.ADAM_AMSGRAD:  # the gradients shrank at times: the max is not v
        assert any(not torch.equal(m, v) for m, v in zip(got_s[2], got_s[1], strict=True))


def test_options_change_the_result() -> None:
    """Clipping, rescaling and each regularization actually act in the configuration tested."""
    w = _params(torch.float64)
    g = _grads(1, [torch.float64] * len(SHAPES))  # scale 3: many entries outside the clip
    outs = {}
    for clip, reg in OPTIONS:
        res = [torch.empty_like(x) for x in w]
        hyper = _hyper(Rule.SGD, "cpu", 0.1)
        optim.sgd_update(w, g, res, None, hyper, clip=clip, regularization=reg)
        outs[clip, reg] = torch.cat([r.flatten() for r in res])
    assert len({tuple(o.tolist()) for o in outs.values()}) == len(OPTIONS)
    plain = torch.cat([(x - 0.1 * 0.75 * y).flatten() for x, y in zip(w, g, strict=True)])
    assert torch.allclose(outs[False, Reg.NONE], plain, rtol=0, atol=1e-15)


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "rule", [Rule.SGD_MOMENTUM, Rule.RMSPROP, Rule.ADAM_AMSGRAD], ids=lambda r: r.name
)
def test_low_precision_gradients_are_read_as_float32(rule, grad_dtype) -> None:
    dtypes = [grad_dtype, torch.float32, grad_dtype, grad_dtype]  # mixed within one list
    values = _params(torch.float32)
    want_w, _ = _reference(rule, values, dtypes, 4, True, Reg.L2)
    got_w, _, _ = _run(rule, values, dtypes, 4, True, Reg.L2, in_place=True)
    for i in range(len(SHAPES)):
        assert_close(got_w[i], want_w[i], f"value {i}", tol=2e-5)


def test_non_contiguous_tensors() -> None:
    base = [torch.randn(5, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)]
    values = [b.t() for b in base]  # transposed views, updated in place
    assert not any(v.is_contiguous() for v in values)
    m = [torch.zeros(5, 4, dtype=torch.float64).t(), torch.zeros(3, 6, dtype=torch.float64)]
    want = [v.clone() for v in values]
    wm = [x.clone() for x in m]
    for k in range(3):
        grads = [torch.randn(v.shape, dtype=torch.float64) for v in values]
        hyper = optim_hyper.make_hyper("cpu", learning_rate=LRS[k], momentum_scale=0.9)
        optim.sgd_update(values, grads, values, m, hyper)
        for i in range(2):
            wm[i] = 0.9 * wm[i] + LRS[k] * grads[i]
            want[i] = want[i] - wm[i]
    for i in range(2):
        assert_close(values[i], want[i], "value", tol=1e-13)
        assert_close(base[i].t(), want[i], "storage", tol=1e-13)
        assert_close(m[i], wm[i], "momentum", tol=1e-13)


# ---------------------------------------------------------------------------------------------
# Adam's step, the hyperparameters in device memory


def test_adam_step_advances_once_per_update_over_all_tensors() -> None:
    w, b = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    m = [torch.zeros_like(w), torch.zeros_like(b)]
    v = [torch.zeros_like(w), torch.zeros_like(b)]
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.01, beta1=0.9, beta2=0.999, epsilon=1e-8)
    step = optim_hyper.make_step("cpu")
    for k in range(1, 4):
        gw, gb = torch.randn_like(w), torch.randn_like(b)
        w0 = w.clone()
        optim.adam_update([w, b], [gw, gb], [w, b], m, v, None, hyper, step)
        assert step.tolist() == [k, 0]  # one update of weights and biases counts once
        # the first update's size is exactly lr_1 = lr sqrt(1 - beta2) / (1 - beta1) times
        # m / (sqrt(v) + eps): checks which t this update used
        lr_t = 0.01 * math.sqrt(1 - 0.999**k) / (1 - 0.9**k)
        want = w0 - lr_t * m[0] / (v[0].sqrt() + 1e-8)
        assert_close(w, want, f"update {k}", tol=1e-13)
    optim_hyper.set_step(step, 100)  # MPS's settable time step
    w0 = w.clone()
    optim.adam_update([w, b], [gw, gb], [w, b], m, v, None, hyper, step)
    lr_t = 0.01 * math.sqrt(1 - 0.999**101) / (1 - 0.9**101)
    assert_close(w, w0 - lr_t * m[0] / (v[0].sqrt() + 1e-8), "after set_step", tol=1e-13)
    assert step.tolist() == [101, 0]
    optim.adam_update([], [], [], [], [], None, hyper, step)  # an empty update still counts
    assert step.tolist() == [102, 0]


def test_hyperparameters_are_read_from_the_tensor_at_each_update() -> None:
    w = [torch.randn(5, dtype=torch.float64)]
    g = [torch.randn(5, dtype=torch.float64)]
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.5)
    lists = (w, g, w, [], hyper)
    want = w[0].clone()
    for lr, rescale in ((0.5, 1.0), (-0.25, 1.0), (0.1, 2.0)):
        optim_hyper.set_hyper(hyper, learning_rate=lr, gradient_rescale=rescale)
        optim.apply_update(Rule.SGD, *lists)  # the same call each time: nothing rebuilt
        want = want - lr * rescale * g[0]
        assert_close(w[0], want, f"lr {lr}", tol=1e-14)
    assert hyper.tolist()[: Hyper.REGULARIZATION_SCALE] == [0.1, 2.0, -math.inf, math.inf]


def test_hyperparameter_layout_and_helpers() -> None:
    h = optim_hyper.make_hyper(
        "cpu", learning_rate=-1.5, gradient_rescale=2, gradient_clip_min=-3,
        gradient_clip_max=4, regularization_scale=5, beta1=6, beta2=7, epsilon=8,
    )  # fmt: skip
    assert h.dtype == torch.float64 and h.tolist() == [-1.5, 2, -3, 4, 5, 6, 7, 8]
    assert Hyper.DECAY == Hyper.BETA1 == Hyper.MOMENTUM_SCALE == 5
    optim_hyper.set_hyper(h, decay=0.25, epsilon=1e-3)
    assert h[5].item() == 0.25 and h[7].item() == 1e-3
    with pytest.raises(ValueError, match="share a slot"):
        optim_hyper.make_hyper("cpu", learning_rate=1, beta1=0.9, decay=0.9)
    with pytest.raises(ValueError, match="finite"):
        optim_hyper.make_hyper("cpu", learning_rate=math.inf)
    with pytest.raises(ValueError, match="finite"):
        optim_hyper.set_hyper(h, learning_rate=math.nan)
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        optim_hyper.set_hyper(h, momentum=0.9)
    s = optim_hyper.make_step("cpu", 7)
    assert s.dtype == torch.int64 and s.tolist() == [7, 0]


def test_init_state_and_argument_checks() -> None:
    w = torch.randn(3, 2).t()
    for rule in Rule:
        st = optim_hyper.init_state(rule, w)
        assert len(st) == len(rule.state_names)
        assert all(s.shape == w.shape and s.is_contiguous() and not s.any() for s in st)
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.1)
    x, g = [torch.zeros(3)], [torch.zeros(3)]
    with pytest.raises(ValueError, match="state lists"):
        optim.apply_update(Rule.ADAM, x, g, x, [x], hyper, optim_hyper.make_step("cpu"))
    with pytest.raises(ValueError, match="step tensor"):
        optim.apply_update(Rule.ADAM, x, g, x, [[torch.zeros(3)]] * 2, hyper)
    with pytest.raises(ValueError, match="shape"):
        optim.apply_update(Rule.SGD, x, [torch.zeros(4)], x, [], hyper)
    with pytest.raises(ValueError, match="tensors"):
        optim.apply_update(Rule.SGD, x, g + g, x, [], hyper)
    with pytest.raises(TypeError, match="float64"):
        optim.apply_update(Rule.SGD, x, [torch.zeros(3, dtype=torch.float64)], x, [], hyper)
    with pytest.raises(TypeError, match="values must be"):
        optim.apply_update(Rule.SGD, [torch.zeros(3).half()], g, x, [], hyper)
    with pytest.raises(ValueError, match="float64 tensor of shape"):
        optim.apply_update(Rule.SGD, x, g, x, [], hyper.float())
    with pytest.raises(ValueError, match="Nesterov"):
        optim.sgd_update(x, g, x, None, hyper, nesterov=True)


def test_lists_are_checked_once_per_list(monkeypatch) -> None:
    """An owner (`UpdatePlans`) keeps each list's answer; an update without one keeps none."""
    plans = optim.UpdatePlans()  # this test's own: addresses may be reused
    calls = []
    real = fast_paths.optimizer_tables
    monkeypatch.setattr(
        fast_paths,
        "optimizer_tables",
        lambda lists, capturing=None: calls.append(1) or real(lists, capturing),
    )
    w, g = [torch.randn(4), torch.randn(2, 2)], [torch.randn(4), torch.randn(2, 2)]
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.1)
    for _ in range(3):
        optim.sgd_update(w, g, w, None, hyper, plans=plans)
    assert len(calls) == 1 and len(plans) == 1
    new = [torch.randn(4), torch.randn(2, 2)]
    optim.sgd_update(w, new, w, None, hyper, plans=plans)  # new gradients
    assert len(calls) == 2 and len(plans) == 2
    for _ in range(2):
        optim.sgd_update(w, g, w, None, hyper)  # no owner: built each time, kept nowhere
    assert len(calls) == 4 and len(plans) == 2


def test_new_gradients_of_checked_lists_check_the_gradients_alone(monkeypatch) -> None:
    """Gradients at new addresses (a training graph's, at every step) re-check the gradient
    list only, and a bad gradient still raises, at a checked key too."""
    plans = optim.UpdatePlans()
    checks = []
    real = optim._check_lists
    monkeypatch.setattr(
        optim,
        "_check_lists",
        lambda *a, only_grads=False: checks.append(only_grads) or real(*a, only_grads=only_grads),
    )
    w = [torch.randn(4), torch.randn(2, 2)]
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.1)
    kept = [[torch.randn(4), torch.randn(2, 2)] for _ in range(2)]  # alive: new addresses
    optim.sgd_update(w, kept[0], w, None, hyper, plans=plans)
    optim.sgd_update(w, kept[1], w, None, hyper, plans=plans)
    assert checks == [False, True]
    with pytest.raises(ValueError, match=r"grads\[1\] has shape \(3,\), values\[1\] \(2, 2\)"):
        optim.sgd_update(w, [torch.randn(4), torch.randn(3)], w, None, hyper, plans=plans)
    with pytest.raises(ValueError, match="grads has 1 tensors, values has 2"):
        optim.sgd_update(w, [torch.randn(4)], w, None, hyper, plans=plans)
    with pytest.raises(TypeError, match=r"grads\[0\] is torch.float64 with torch.float32 values"):
        optim.sgd_update(
            w, [torch.randn(4).double(), torch.randn(2, 2)], w, None, hyper, plans=plans
        )
    other = [torch.randn(4), torch.randn(2, 2)]  # new results: every list is checked again
    optim.sgd_update(w, kept[0], other, None, hyper, plans=plans)
    assert checks[-1] is False


def test_a_tensor_of_another_layout_at_a_checked_address_is_checked_again() -> None:
    """The cached check covers the dtype, shape and contiguity of every non-gradient tensor,
    not only its address: a view at the same address with another dtype or shape is refused
    (with new gradients, the key of a training step)."""
    plans = optim.UpdatePlans()
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.1, momentum_scale=0.9)
    rule = Rule.SGD_MOMENTUM
    v, r, mom = torch.ones(4), torch.empty(4), torch.zeros(4)
    optim.apply_update(rule, [v], [torch.ones(4)], [r], [[mom]], hyper, plans=plans)
    with pytest.raises(TypeError, match=r"results\[0\] is torch.int32 with torch.float32"):
        optim.apply_update(
            rule, [v], [torch.ones(4)], [r.view(torch.int32)], [[mom]], hyper, plans=plans
        )
    with pytest.raises(ValueError, match=r"results\[0\] has shape \(2, 2\), values\[0\] \(4,\)"):
        optim.apply_update(rule, [v], [torch.ones(4)], [r.view(2, 2)], [[mom]], hyper, plans=plans)
    with pytest.raises(TypeError, match=r"momentum\[0\] is torch.int32 with torch.float32"):
        optim.apply_update(
            rule, [v], [torch.ones(4)], [r], [[mom.view(torch.int32)]], hyper, plans=plans
        )


# ---------------------------------------------------------------------------------------------
# torch.optim where the formulas coincide


def _torch_run(opt_cls, kwargs, steps, per_step=None, grad_dtype=torch.float64):
    values = _params(torch.float64, shapes=SHAPES[:2])
    params = [torch.nn.Parameter(v.clone()) for v in values]
    opt = opt_cls(params, **kwargs)
    for k in range(steps):
        if per_step:
            per_step(opt, k)
        for p, g in zip(params, _grads(k, [grad_dtype] * 2, shapes=SHAPES[:2]), strict=True):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def _mps_run(rule, p, steps, reg=Reg.NONE, lrs=None):
    values = _params(torch.float64, shapes=SHAPES[:2])
    states = _states(rule, values)
    hyper = optim_hyper.make_hyper("cpu", **p)
    step = optim_hyper.make_step("cpu")
    for k in range(steps):
        if lrs:
            optim_hyper.set_hyper(hyper, learning_rate=lrs[k])
        g = _grads(k, [torch.float64] * 2, shapes=SHAPES[:2])
        before = [x.clone() for x in g]
        optim.apply_update(rule, values, g, values, states, hyper, step, regularization=reg)
        assert all(torch.equal(x, b) for x, b in zip(g, before, strict=True))  # only read
    return values


def _same(a, b, what, tol=1e-12):
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert_close(x, y, f"{what} {i}", tol=tol)


def _lr_schedule(opt, k):
    opt.param_groups[0]["lr"] = LRS[k]


def test_sgd_equals_torch_sgd_without_momentum_and_with_weight_decay() -> None:
    got = _mps_run(Rule.SGD, dict(learning_rate=0.1), 5, lrs=LRS)
    _same(got, _torch_run(torch.optim.SGD, dict(lr=0.1), 5, _lr_schedule), "sgd")
    got = _mps_run(Rule.SGD, dict(learning_rate=0.1, regularization_scale=0.01), 5, Reg.L2, LRS)
    want = _torch_run(torch.optim.SGD, dict(lr=0.1, weight_decay=0.01), 5, _lr_schedule)
    _same(got, want, "sgd L2 = weight decay")


def test_sgd_momentum_equals_torch_at_a_constant_learning_rate_only() -> None:
    # MPS keeps m = mu m + lr g, torch b = mu b + g and steps lr b: m = lr b while lr is fixed
    p = dict(learning_rate=0.1, momentum_scale=0.9)
    want = _torch_run(torch.optim.SGD, dict(lr=0.1, momentum=0.9), 5)
    _same(_mps_run(Rule.SGD_MOMENTUM, p, 5), want, "momentum")
    got = _mps_run(Rule.SGD_MOMENTUM, p, 5, lrs=LRS)
    other = _torch_run(torch.optim.SGD, dict(lr=0.1, momentum=0.9), 5, _lr_schedule)
    diff = max((x - y).abs().max().item() for x, y in zip(got, other, strict=True))
    assert diff > 1e-3  # the learning rate changed: the two momenta part ways
    # Nesterov's definitions coincide, whatever the learning rates
    p = dict(learning_rate=0.1, momentum_scale=0.8)
    want = _torch_run(torch.optim.SGD, dict(lr=0.1, momentum=0.8, nesterov=True), 5, _lr_schedule)
    _same(_mps_run(Rule.SGD_NESTEROV, p, 5, lrs=LRS), want, "nesterov")


def test_rmsprop_equals_torch_rmsprop() -> None:
    # both add eps outside the square root: alpha = decay, centered=False, momentum=0
    p = dict(learning_rate=0.01, decay=0.9, epsilon=1e-2, regularization_scale=0.05)
    want = _torch_run(
        torch.optim.RMSprop, dict(lr=0.01, alpha=0.9, eps=1e-2, weight_decay=0.05), 5, _lr_schedule
    )
    _same(_mps_run(Rule.RMSPROP, p, 5, Reg.L2, LRS), want, "rmsprop")


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_equals_torch_adam_with_eps_rescaled(amsgrad) -> None:
    rule = Rule.ADAM_AMSGRAD if amsgrad else Rule.ADAM
    b1, b2, eps, steps = 0.9, 0.99, 1e-2, 6
    p = dict(learning_rate=0.05, beta1=b1, beta2=b2, epsilon=eps)
    got = _mps_run(rule, p, steps, lrs=LRS)

    def schedule(opt, k):
        # torch divides by sqrt(v) / sqrt(1 - b2^t) + eps': MPS's eps is eps' sqrt(1 - b2^t)
        opt.param_groups[0]["lr"] = LRS[k]
        opt.param_groups[0]["eps"] = eps / math.sqrt(1 - b2 ** (k + 1))

    kw = dict(lr=0.05, betas=(b1, b2), amsgrad=amsgrad)
    _same(got, _torch_run(torch.optim.Adam, dict(kw, eps=eps), steps, schedule), "adam")
    # the same eps in both does not give the same result...
    plain = _torch_run(torch.optim.Adam, dict(kw, eps=eps), steps, _lr_schedule)
    assert max((x - y).abs().max().item() for x, y in zip(got, plain, strict=True)) > 1e-4
    # ...except for eps = 0
    got0 = _mps_run(rule, dict(p, epsilon=0.0), steps, lrs=LRS)
    _same(got0, _torch_run(torch.optim.Adam, dict(kw, eps=0.0), steps, _lr_schedule), "eps 0")


def test_adam_l2_equals_torch_adam_weight_decay() -> None:
    p = dict(learning_rate=0.05, beta1=0.9, beta2=0.99, epsilon=0.0, regularization_scale=0.1)
    kw = dict(lr=0.05, betas=(0.9, 0.99), eps=0.0, weight_decay=0.1)
    _same(_mps_run(Rule.ADAM, p, 4, Reg.L2), _torch_run(torch.optim.Adam, kw, 4), "adam L2")
