"""MPS's optimizer updates (SGD, RMSProp, Adam) against their formulas written out in float64
here, against torch.optim where the formulas coincide (and where they do not, the exact
relation), and the Triton multi-tensor kernel against the portable path (on the CPU in
Triton's interpreter). Hyperparameters and Adam's step live in device memory: an update
follows `set_hyper` without being rebuilt, and a captured CUDA graph follows it too."""

from __future__ import annotations

import gc
import math
import warnings

import pytest
import torch

from mpsnn.ops import optim
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.optim import RegularizationType as Reg
from mpsnn.ops.optim import UpdateRule as Rule
from mpsnn.ops.triton import optim as triton_optim  # the dev setup installs Triton
from tests.helpers import TRITON_DEVICES, assert_close

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

SHAPES = [(4, 3, 3, 3), (4,), (1,), (7, 5)]  # conv weight, bias, a single element, a matrix
LRS = [0.1, 0.05, -0.02, 0.2, 0.01, 0.07]  # changed between steps, one negative
SCALES = [1.0, 3.0, 0.2, 2.0, 0.1, 1.0]  # gradient sizes vary, so AMSGrad's max matters
HYPER = dict(
    gradient_rescale=0.75,
    gradient_clip_min=-0.8,
    gradient_clip_max=0.6,
    regularization_scale=0.03,
    beta2=0.99,
    epsilon=1e-2,
)
SLOT5 = {  # momentum_scale / decay / beta1
    Rule.SGD: 0.0,
    Rule.SGD_MOMENTUM: 0.9,
    Rule.SGD_NESTEROV: 0.8,
    Rule.RMSPROP: 0.9,
    Rule.ADAM: 0.9,
    Rule.ADAM_AMSGRAD: 0.85,
}
OPTIONS = [(clip, reg) for clip in (False, True) for reg in Reg]


def _option_id(x) -> str:
    return x.name if isinstance(x, Reg) else ("clip" if x else "noclip")


# ---------------------------------------------------------------------------------------------
# the formulas, in float64, one parameter at a time


def ref_gradient(w, g, p, clip, reg):
    if clip:
        g = torch.clamp(g, p["gradient_clip_min"], p["gradient_clip_max"])
    g = p["gradient_rescale"] * g
    if reg == Reg.L1:
        g = g + p["regularization_scale"] * torch.sign(w)
    elif reg == Reg.L2:
        g = g + p["regularization_scale"] * w
    return g


def ref_update(rule, w, g, state, p, t):
    """``w_new``; ``state`` (a list of tensors) is replaced in place; ``t``: Adam's step after
    the increment."""
    lr, a = p["learning_rate"], p["slot5"]
    if rule == Rule.SGD:
        return w - lr * g
    if rule == Rule.SGD_MOMENTUM:
        state[0] = a * state[0] + lr * g
        return w - state[0]
    if rule == Rule.SGD_NESTEROV:
        state[0] = a * state[0] + g
        return w - lr * (g + a * state[0])
    if rule == Rule.RMSPROP:
        state[0] = a * state[0] + (1 - a) * g * g
        return w - lr * g / (torch.sqrt(state[0]) + p["epsilon"])
    b1, b2, eps = a, p["beta2"], p["epsilon"]
    lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
    state[0] = b1 * state[0] + (1 - b1) * g
    state[1] = b2 * state[1] + (1 - b2) * g * g
    if rule == Rule.ADAM_AMSGRAD:
        state[2] = torch.maximum(state[2], state[1])
        return w - lr_t * state[0] / (torch.sqrt(state[2]) + eps)
    return w - lr_t * state[0] / (torch.sqrt(state[1]) + eps)


# ---------------------------------------------------------------------------------------------
# helpers


def _params(dtype, device="cpu", shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype) for s in shapes]


def _grads(step, dtypes, device="cpu", shapes=SHAPES, seed=100):
    gen = torch.Generator().manual_seed(seed + step)
    return [
        (SCALES[step % len(SCALES)] * torch.randn(s, generator=gen, dtype=torch.float64)).to(
            device, dt
        )
        for s, dt in zip(shapes, dtypes, strict=True)
    ]


def _hyper(rule, device, lr):
    return optim.make_hyper(device, learning_rate=lr, momentum_scale=SLOT5[rule], **HYPER)


def _ref_params(rule, lr):
    return dict(HYPER, learning_rate=lr, slot5=SLOT5[rule])


def _states(rule, values):
    """One list per state vector; RMSProp's and Adam's second moments start at 0 like MPS."""
    per_param = [optim.init_state(rule, v) for v in values]
    return [list(col) for col in zip(*per_param, strict=True)] if per_param[0] else []


def _run(rule, values, grad_dtypes, steps, clip, reg, in_place, device="cpu", update=None):
    """``steps`` updates with changing gradients and learning rates; returns the final values,
    states and step. ``update(lists..., hyper, step)`` defaults to `optim.apply_update`."""
    update = update or (
        lambda v, g, r, s, h, st: optim.apply_update(
            rule, v, g, r, s, h, st, clip=clip, regularization=reg
        )
    )
    states = _states(rule, values)
    hyper = _hyper(rule, device, LRS[0])
    step = optim.make_step(device)
    spare = [torch.empty_like(v) for v in values]
    for k in range(steps):
        optim.set_hyper(hyper, learning_rate=LRS[k])
        grads = _grads(k, grad_dtypes, device, [tuple(v.shape) for v in values])
        grads_before = [x.clone() for x in grads]
        if in_place:
            update(values, grads, values, states, hyper, step)
        else:
            before = [v.clone() for v in values]
            update(values, grads, spare, states, hyper, step)
            for v, b in zip(values, before, strict=True):
                assert torch.equal(v, b), "an out-of-place update wrote its input values"
            values, spare = spare, values
        for x, b in zip(grads, grads_before, strict=True):
            assert torch.equal(x, b), "an update wrote its gradients"
    return values, states, step


def _reference(rule, values, grad_dtypes, steps, clip, reg):
    w = [v.detach().double().cpu() for v in values]
    st = [[torch.zeros_like(x) for _ in rule.state_names] for x in w]
    for k in range(steps):
        p = _ref_params(rule, LRS[k])
        grads = _grads(k, grad_dtypes, "cpu", [tuple(x.shape) for x in w])
        for i in range(len(w)):
            g = ref_gradient(w[i], grads[i].double(), p, clip, reg)
            w[i] = ref_update(rule, w[i], g, st[i], p, k + 1)
    return w, [[s[j] for s in st] for j in range(len(rule.state_names))]


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
        hyper = optim.make_hyper("cpu", learning_rate=LRS[k], momentum_scale=0.9)
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
    hyper = optim.make_hyper("cpu", learning_rate=0.01, beta1=0.9, beta2=0.999, epsilon=1e-8)
    step = optim.make_step("cpu")
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
    optim.set_step(step, 100)  # MPS's settable time step
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
    hyper = optim.make_hyper("cpu", learning_rate=0.5)
    lists = (w, g, w, [], hyper)
    want = w[0].clone()
    for lr, rescale in ((0.5, 1.0), (-0.25, 1.0), (0.1, 2.0)):
        optim.set_hyper(hyper, learning_rate=lr, gradient_rescale=rescale)
        optim.apply_update(Rule.SGD, *lists)  # the same call each time: nothing rebuilt
        want = want - lr * rescale * g[0]
        assert_close(w[0], want, f"lr {lr}", tol=1e-14)
    assert hyper.tolist()[: optim.Hyper.REGULARIZATION_SCALE] == [0.1, 2.0, -math.inf, math.inf]


def test_hyperparameter_layout_and_helpers() -> None:
    h = optim.make_hyper(
        "cpu", learning_rate=-1.5, gradient_rescale=2, gradient_clip_min=-3,
        gradient_clip_max=4, regularization_scale=5, beta1=6, beta2=7, epsilon=8,
    )  # fmt: skip
    assert h.dtype == torch.float64 and h.tolist() == [-1.5, 2, -3, 4, 5, 6, 7, 8]
    assert optim.Hyper.DECAY == optim.Hyper.BETA1 == optim.Hyper.MOMENTUM_SCALE == 5
    optim.set_hyper(h, decay=0.25, epsilon=1e-3)
    assert h[5].item() == 0.25 and h[7].item() == 1e-3
    with pytest.raises(ValueError, match="share a slot"):
        optim.make_hyper("cpu", learning_rate=1, beta1=0.9, decay=0.9)
    with pytest.raises(ValueError, match="finite"):
        optim.make_hyper("cpu", learning_rate=math.inf)
    with pytest.raises(ValueError, match="finite"):
        optim.set_hyper(h, learning_rate=math.nan)
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        optim.set_hyper(h, momentum=0.9)
    s = optim.make_step("cpu", 7)
    assert s.dtype == torch.int64 and s.tolist() == [7, 0]


def test_init_state_and_argument_checks() -> None:
    w = torch.randn(3, 2).t()
    for rule in Rule:
        st = optim.init_state(rule, w)
        assert len(st) == len(rule.state_names)
        assert all(s.shape == w.shape and s.is_contiguous() and not s.any() for s in st)
    hyper = optim.make_hyper("cpu", learning_rate=0.1)
    x, g = [torch.zeros(3)], [torch.zeros(3)]
    with pytest.raises(ValueError, match="state lists"):
        optim.apply_update(Rule.ADAM, x, g, x, [x], hyper, optim.make_step("cpu"))
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
    monkeypatch.setattr(optim, "_PLANS", type(optim._PLANS)())  # addresses may be reused
    calls = []
    real = fast_paths.optimizer_tables
    monkeypatch.setattr(
        fast_paths,
        "optimizer_tables",
        lambda lists, capturing=None: calls.append(1) or real(lists, capturing),
    )
    w, g = [torch.randn(4), torch.randn(2, 2)], [torch.randn(4), torch.randn(2, 2)]
    hyper = optim.make_hyper("cpu", learning_rate=0.1)
    for _ in range(3):
        optim.sgd_update(w, g, w, None, hyper)
    assert len(calls) == 1
    optim.sgd_update(w, [torch.randn(4), torch.randn(2, 2)], w, None, hyper)  # new gradients
    assert len(calls) == 2


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
    hyper = optim.make_hyper("cpu", **p)
    step = optim.make_step("cpu")
    for k in range(steps):
        if lrs:
            optim.set_hyper(hyper, learning_rate=lrs[k])
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
        hyper, step = _hyper(Rule.ADAM, device, 0.1), optim.make_step(device)
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
    They are staged through host buffers (pinned on CUDA), copied without waiting, kept out of
    the shared chunk cache, and kept for the graphs. ``capturing=True`` forces that route here:
    on CUDA nothing is captured, and on the CPU nothing can be (the buffers are not pinned)."""
    monkeypatch.setattr(triton_optim, "_CHUNKS", type(triton_optim._CHUNKS)())
    monkeypatch.setattr(triton_optim, "_GRAPH_TABLES", {})
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
    assert list(triton_optim._GRAPH_TABLES.values()) == [staged, again]  # kept for graphs

    w0 = [v.clone() for v in values]
    hyper = _hyper(Rule.ADAM, device, 0.1)
    runs = []
    for t in (eager, staged, again):  # the same update of the same tensors, three times
        for v, x in zip(values, w0, strict=True):
            v.copy_(x)
        for s in states:
            for x in s:
                x.zero_()
        step = optim.make_step(device)
        for _ in range(2):
            t.launch(Rule.ADAM, hyper, step, True, Reg.L1)
        runs.append([x.clone() for x in (*values, *states[0], *states[1], step)])
    for run in runs[1:]:
        for i, (a, b) in enumerate(zip(run, runs[0], strict=True)):
            assert torch.equal(a, b), f"tensor {i}"
    assert triton_optim.release_graph_tables() == 2 and not triton_optim._GRAPH_TABLES


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_tables_first_seen_in_a_capture_are_not_cached(device, monkeypatch) -> None:
    """`apply_update`'s cache around captures, which are simulated here by replacing the
    capture status and the dispatch, so that this also runs on the CPU. Tables built during a
    capture are used without a warning, kept for the graph, and not cached. A cached table used
    during a capture is kept for the graph too. All of them update the same bits."""
    monkeypatch.setattr(optim, "_PLANS", type(optim._PLANS)())
    monkeypatch.setattr(triton_optim, "_GRAPH_TABLES", {})
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
    kept = triton_optim._GRAPH_TABLES

    def update() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            optim.sgd_update(values, grads, values, momenta, hyper)
        ref.launch(Rule.SGD_MOMENTUM, hyper, None, False, Reg.NONE)

    update()  # first seen during a capture: this capture's own tables
    assert built == [True] and len(optim._PLANS) == 0 and len(kept) == 1
    capturing[0] = False
    update()  # outside: built again, eagerly, and cached
    assert built == [True, False] and len(optim._PLANS) == 1 and len(kept) == 1
    update()  # cached
    assert built == [True, False] and len(kept) == 1
    capturing[0] = True
    update()  # cached, used by a capture: kept for its graph
    assert built == [True, False] and len(kept) == 2
    ((_, cached_plan),) = optim._PLANS.values()
    assert cached_plan in kept.values()
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


# ---------------------------------------------------------------------------------------------
# CUDA only: the whole dispatch at a larger size, and CUDA-graph capture


def test_cuda_update_and_graph_capture(monkeypatch) -> None:
    """On the CPU: an update reads learning rate and step from their tensors each time (what a
    captured graph relies on). On CUDA also: the dispatched Triton update equals the portable
    one over a million-element list, and a captured Adam update follows the learning rate and
    advances the step at every replay."""
    w = [torch.randn(6)]
    m, v = [torch.zeros(6)], [torch.zeros(6)]
    hyper = optim.make_hyper("cpu", learning_rate=0.1, beta1=0.9, beta2=0.99, epsilon=1e-3)
    step = optim.make_step("cpu")
    g = [torch.ones(6)]
    optim.adam_update(w, g, w, m, v, None, hyper, step)
    w1 = w[0].clone()
    optim.set_hyper(hyper, learning_rate=0.0)
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


def _own_caches(monkeypatch) -> None:
    """Empty table caches and an empty list of tables kept for graphs, owned by this test."""
    monkeypatch.setattr(optim, "_PLANS", type(optim._PLANS)())
    monkeypatch.setattr(triton_optim, "_CHUNKS", type(triton_optim._CHUNKS)())
    monkeypatch.setattr(triton_optim, "_GRAPH_TABLES", {})


def _drop_caches() -> list[torch.Tensor]:
    """Evict everything from the table caches (the test's own: `_own_caches`) and collect.
    Then fill freshly allocated device memory with -1. Had a graph's tables been freed with
    their cache entries, that memory would now hold -1 "addresses". Returns the filler; keep
    it until the replays are done."""
    optim._PLANS.clear()
    triton_optim._CHUNKS.clear()
    gc.collect()
    return [torch.full((n,), -1, dtype=torch.int64, device="cuda") for n in (4, 16, 64, 512, 4096)]


def _capture_and_replay(shapes, monkeypatch) -> None:
    _own_caches(monkeypatch)
    rule = Rule.ADAM_AMSGRAD
    values = _params(torch.float32, "cuda", shapes, seed=6)
    grads = [torch.randn_like(x) for x in values]
    ref = [x.double().cpu() for x in values]
    ref_state = [[torch.zeros_like(x) for _ in range(3)] for x in ref]
    states = _states(rule, values)
    hyper = _hyper(rule, "cuda", 0.01)
    step = optim.make_step("cuda")

    def update() -> None:
        optim.apply_update(rule, values, grads, values, states, hyper, step, clip=True)

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
    with torch.cuda.graph(graph):
        update()
    filler = _drop_caches()
    for k, lr in enumerate([0.02, -0.01, 0.005]):
        optim.set_hyper(hyper, learning_rate=lr)
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
    _own_caches(monkeypatch)

    def fresh():
        values = _params(torch.float32, "cuda", GRAPH_SHAPES, seed=8)
        hyper = _hyper(rule, "cuda", LRS[0])
        return values, _states(rule, values), hyper, optim.make_step("cuda")

    def update(values, grads, states, hyper, step):
        optim.apply_update(
            rule, values, grads, values, states, hyper, step, clip=clip, regularization=reg
        )

    # the eager Triton path; it also compiles every kernel variant the capture launches
    eager = fresh()
    for k in range(steps):
        optim.set_hyper(eager[2], learning_rate=LRS[k])
        update(eager[0], sources[k], *eager[1:])
    assert len(optim._PLANS) == steps and all(plan for _, plan in optim._PLANS.values())
    assert len(triton_optim._CHUNKS) == 1 and not triton_optim._GRAPH_TABLES
    if chunks != "cached":
        triton_optim._CHUNKS.clear()

    values, states, hyper, step = fresh()
    grads: list[torch.Tensor] = []
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.cuda.graph(graph, capture_error_mode=mode):
            grads += [
                torch.empty(s, dtype=dt, device="cuda")
                for s, dt in zip(GRAPH_SHAPES, GRAPH_GRADS, strict=True)
            ]
            update(values, grads, states, hyper, step)
    assert len(optim._PLANS) == steps  # the capture's tables are not cached
    (kept,) = triton_optim._GRAPH_TABLES.values()  # but kept for the graph
    assert len(kept.staged) == (1 if chunks == "cached" else 1 + len(kept.groups))
    assert all(t.is_pinned() for t in kept.staged)
    assert len(triton_optim._CHUNKS) == (1 if chunks == "cached" else 0)
    del kept
    filler = _drop_caches()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(steps):
            for g, src in zip(grads, sources[k], strict=True):
                g.copy_(src)  # new gradient values, in place
            optim.set_hyper(hyper, learning_rate=LRS[k])
            graph.replay()
    torch.cuda.synchronize()
    assert all((f == -1).all() for f in filler)
    got = [*values, *(x for s in states for x in s), step]
    want = [*eager[0], *(x for s in eager[1] for x in s), eager[3]]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"tensor {i} differs from the eager Triton path"
    if rule in (Rule.ADAM, Rule.ADAM_AMSGRAD):
        assert step.tolist() == [steps, 0]


@needs_cuda
def test_cuda_graph_tables_staged_with_pinned_copies_pending(monkeypatch) -> None:
    """The staging works even when PyTorch's pinned-memory allocator has events left to
    process: a pinned buffer freed after a non-blocking copy leaves one, as a data loader
    with pinned memory does. Allocating a pinned buffer inside the capture must not query
    that event. `build_tables` called directly inside a capture works too."""
    _own_caches(monkeypatch)
    hyper = optim.make_hyper("cuda", learning_rate=0.5)
    warm = [[torch.zeros(8, device="cuda")] for _ in range(3)]
    optim.sgd_update(*warm, None, hyper)  # compiles the kernel (SGD, no clip, float32)
    host = torch.ones(1 << 16, pin_memory=True)
    torch.empty(1 << 16, device="cuda").copy_(host, non_blocking=True)
    del host  # freed with its copy's event recorded, processed by a later pinned allocation
    fresh = [torch.zeros(8, device="cuda")]
    other = [torch.zeros(8, device="cuda")]
    ones = [torch.ones(8, device="cuda")]
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            optim.sgd_update(fresh, ones, fresh, None, hyper)
            tables = triton_optim.build_tables([other, ones, other])
            tables.launch(Rule.SGD, hyper, None, False, Reg.NONE)
    assert len(triton_optim._GRAPH_TABLES) == 2 and len(optim._PLANS) == 1  # the warm-up's
    del tables
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert fresh[0].tolist() == [-1.0] * 8 and other[0].tolist() == [-1.0] * 8
