"""Shared by the optimizer-update tests (`test_optim_ops`, `test_optim_triton`,
`test_optim_cuda_graphs`): the test configuration (shapes, learning-rate schedule, gradient
scales, hyperparameters), MPS's update formulas written out in float64, one parameter at a
time, and the drivers that run `mpsnn.ops.optim` (or a replacement update) over several steps
and the float64 reference beside it."""

from __future__ import annotations

import math

import torch

from mpsnn.ops import optim, optim_hyper
from mpsnn.ops.optim_hyper import RegularizationType as Reg
from mpsnn.ops.optim_hyper import UpdateRule as Rule

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
    return optim_hyper.make_hyper(device, learning_rate=lr, momentum_scale=SLOT5[rule], **HYPER)


def _ref_params(rule, lr):
    return dict(HYPER, learning_rate=lr, slot5=SLOT5[rule])


def _states(rule, values):
    """One list per state vector; RMSProp's and Adam's second moments start at 0 like MPS."""
    per_param = [optim_hyper.init_state(rule, v) for v in values]
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
    step = optim_hyper.make_step(device)
    spare = [torch.empty_like(v) for v in values]
    for k in range(steps):
        optim_hyper.set_hyper(hyper, learning_rate=LRS[k])
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
