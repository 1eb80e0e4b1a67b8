"""``mpsnn train``'s learning-rate schedules and update/loss options: each schedule's rates
equal its documented formula and are what the optimizer runs with at every step; momentum,
weight decay, gradient clipping and label smoothing reach the MPS descriptors and the PyTorch
twin's equivalents (the two frameworks then train alike); bad values are one ``Error:`` line
before any training work; a resumed run keeps the options, refuses conflicting ones, and a
checkpoint written before these options existed resumes with their defaults."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.cli.common import UserError
from mpsnn.cli.runs import check_schedule
from mpsnn.cli.schedules import ADDED_OPTIONS, Schedule
from mpsnn.cli.torch_baseline import torch_loss, torch_optimizer
from mpsnn.cli.trainer import TrainConfig, Trainer
from mpsnn.ops.optim_hyper import Hyper
from tests.cli._helpers import no_training  # noqa: F401  (a fixture)
from tests.cli._helpers import run_cli as _run

# 160 images in batches of 32: 5 steps per epoch
SMALL = ["--dataset", "synthetic", "--model", "lenet", "--limit", "160", "--test-limit", "32",
         "--batch-size", "32", "--device", "cpu"]  # fmt: skip


def _one_error(out: str) -> str:
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), out
    return lines[0]


# -- the formulas ------------------------------------------------------------------------------


def _expected(kind: str, e: int, s: int, *, lr: float, d: float, k: int, warm: int,
              epochs: int, steps: int) -> float:  # fmt: skip
    """The documented formulas, written out independently of `Schedule`."""
    g = (e - 1) * steps + s
    if kind == "constant":
        rate = lr
    elif kind == "exponential":
        rate = lr * d ** (e - 1)
    elif kind == "step":
        rate = lr * d ** ((e - 1) // k)
    else:
        p = max(0, g - warm) / (epochs * steps - warm)
        rate = lr * (1 + math.cos(math.pi * p)) / 2
    if g < warm:
        rate *= (g + 1) / warm
    return rate


@pytest.mark.parametrize("kind", ["constant", "exponential", "step", "cosine"])
@pytest.mark.parametrize("warmup", [0.0, 0.4, 1.0, 2.5])
def test_every_step_rate_follows_the_documented_formula(kind: str, warmup: float) -> None:
    epochs, steps = 5, 7
    sched = Schedule(0.03, kind, 0.5, 2, warmup, epochs, steps)
    warm = 0 if warmup == 0 else max(1, round(warmup * steps))
    assert sched.warmup_steps == warm
    for e in range(1, epochs + 1):
        for s in range(steps):
            want = _expected(kind, e, s, lr=0.03, d=0.5, k=2, warm=warm, epochs=epochs,
                             steps=steps)  # fmt: skip
            assert sched.rate(e, s) == pytest.approx(want, rel=1e-12, abs=1e-15), (e, s)
    assert sched.per_step == (kind == "cosine" or warmup > 0)


def test_the_default_schedule_is_the_old_per_epoch_decay() -> None:
    """The default (exponential 0.6, no warmup) gives epoch e the rate lr · 0.6^(e-1) at every
    step, as before the option existed."""
    config = TrainConfig()
    sched = Schedule.of(config, 937)
    assert (config.schedule, config.lr_decay, config.warmup_epochs) == ("exponential", 0.6, 0.0)
    for e in range(1, 6):
        assert {sched.rate(e, s) for s in (0, 400, 936)} == {1e-3 * 0.6 ** (e - 1)}
    assert not sched.per_step


def test_cosine_falls_from_lr_after_the_warmup_towards_zero() -> None:
    sched = Schedule(0.1, "cosine", 0.6, 2, 1.0, 4, 10)
    rates = [sched.rate(e, s) for e in range(1, 5) for s in range(10)]
    assert rates[0] == pytest.approx(0.01)  # lr / 10 warmup steps
    assert rates[9] == pytest.approx(0.1) and rates[10] == pytest.approx(0.1)
    assert all(a > b for a, b in itertools.pairwise(rates[10:]))
    assert 0 < rates[-1] < 0.1 * 1e-2


def test_step_overflow_is_checked_with_the_step_formula() -> None:
    check_schedule(1e-3, "adam", 1e200, 3, "step", 10)  # floor(2/10) = 0: lr itself
    check_schedule(1e-3, "adam", 1e200, 3, "cosine", 2)  # the decay is not used
    with pytest.raises(UserError, match=r"epoch 5 \(lr · decay\^floor\(\(epoch-1\)/2\)\) overflow"):
        check_schedule(1e-3, "adam", 1e200, 5, "step", 2)


# -- the trainer applies them ----------------------------------------------------------------


def _trainer(**options: Any) -> Trainer:
    config = TrainConfig(model="lenet", dataset="synthetic", batch_size=32, limit=160,
                         test_limit=32, device="cpu", compile=False, **options)  # fmt: skip
    return Trainer(config)


def _spy_rates(trainer: Trainer) -> list[float]:
    """The learning rate in the optimizer's device memory at each training step."""
    seen: list[float] = []
    encode = trainer.graph.encode_batch

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(float(trainer.optimizer._hyper[Hyper.LEARNING_RATE]))
        return encode(*args, **kwargs)

    trainer.graph.encode_batch = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize(
    "options",
    [{"schedule": "cosine", "warmup_epochs": 0.6}, {"schedule": "step", "lr_decay": 0.5,
     "step_epochs": 1}, {"schedule": "exponential"}],
    ids=["cosine+warmup", "step", "exponential"],
)  # fmt: skip
def test_the_trainer_runs_each_step_at_the_schedule_rate(options: dict[str, Any]) -> None:
    trainer = _trainer(epochs=2, optimizer="sgd", lr=0.01, **options)
    seen = _spy_rates(trainer)
    for _ in range(2):
        trainer.train_epoch()
    want = [trainer.schedule.rate(e, s) for e in (1, 2) for s in range(5)]
    assert seen == pytest.approx(want, rel=1e-12)
    assert [r["lr"] for r in trainer.history] == [want[0], want[5]]
    c = trainer.config
    formula = _expected(c.schedule, 2, 3, lr=0.01, d=c.lr_decay, k=c.step_epochs,
                        warm=trainer.schedule.warmup_steps, epochs=2, steps=5)  # fmt: skip
    assert seen[8] == pytest.approx(formula, rel=1e-12)


# -- the options reach MPS's descriptors and the PyTorch twin --------------------------------


def _loss_kernels(graph: Any) -> list[Any]:
    return [k for k in graph._plan.kernels.values() if hasattr(k, "label_smoothing")]


def test_update_and_loss_options_reach_the_descriptors() -> None:
    trainer = _trainer(optimizer="sgd", momentum=0.5, weight_decay=1e-3, clip_grad=0.25,
                       label_smoothing=0.1)  # fmt: skip
    opt = trainer.optimizer
    assert isinstance(opt, m.SGD) and opt.momentum_scale == 0.5
    assert opt.regularization_type == m.RegularizationType.L2
    assert opt.regularization_scale == 1e-3
    assert opt.apply_gradient_clipping and (opt.gradient_clip_min, opt.gradient_clip_max) == (
        -0.25, 0.25)  # fmt: skip
    assert all(ds.optimizer is opt for ds in trainer.model.data_sources)
    (loss,) = _loss_kernels(trainer.graph)
    assert loss.label_smoothing == pytest.approx(0.1)
    defaults = _trainer(optimizer="sgd")
    assert defaults.optimizer.momentum_scale == 0.9
    assert defaults.optimizer.regularization_type == m.RegularizationType.NONE
    assert not defaults.optimizer.apply_gradient_clipping
    assert _loss_kernels(defaults.graph)[0].label_smoothing == 0


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "rmsprop"])
def test_the_torch_twin_gets_the_same_options(optimizer: str) -> None:
    config = TrainConfig(optimizer=optimizer, momentum=0.5 if optimizer == "sgd" else None,
                         weight_decay=2e-3, clip_grad=0.25, label_smoothing=0.2)  # fmt: skip
    params = [torch.nn.Parameter(torch.randn(3))]
    group = torch_optimizer(config, params, 0.01, cuda=False).param_groups[0]
    assert group["lr"] == 0.01 and group["weight_decay"] == 2e-3
    if optimizer == "sgd":
        assert group["momentum"] == 0.5
    logits, labels = torch.randn(6, 10, dtype=torch.float64), torch.randint(0, 10, (6,))
    assert torch.equal(torch_loss(config)(logits, labels),
                       F.cross_entropy(logits, labels, label_smoothing=0.2))  # fmt: skip


def _first_epoch_losses(tmp_path: Path, *flags: str) -> tuple[float, float]:
    log = tmp_path / "m.jsonl"
    code, out = _run("train", *SMALL, "--epochs", "1", "--compare-torch", "--metrics", str(log),
                     "--overwrite", *flags)  # fmt: skip
    assert code == 0, out
    records = [json.loads(x) for x in log.read_text().splitlines()]
    mpsnn_, torch_ = (r["train_loss"] for r in records if r["kind"] == "epoch")
    return mpsnn_, torch_


@pytest.fixture(scope="module")
def plain_sgd(tmp_path_factory: pytest.TempPathFactory) -> tuple[float, float]:
    return _first_epoch_losses(tmp_path_factory.mktemp("plain"), *_SGD)


_SGD = ("--optimizer", "sgd", "--lr", "0.05", "--schedule", "constant")


@pytest.mark.parametrize(
    "flags",
    [("--momentum", "0"), ("--weight-decay", "0.5"), ("--clip-grad", "0.001"),
     ("--label-smoothing", "0.3"),
     ("--momentum", "0", "--weight-decay", "0.5", "--clip-grad", "0.001",
      "--label-smoothing", "0.3")],
    ids=["momentum", "weight-decay", "clip-grad", "label-smoothing", "all"],
)  # fmt: skip
def test_mpsnn_and_the_twin_train_alike_with_each_option(
    tmp_path: Path, plain_sgd: tuple[float, float], flags: tuple[str, ...]
) -> None:
    """Same weights, data and options: the epoch's losses agree (float32 rounding), and the
    option moves them by far more than that (neither framework ignores it)."""
    mpsnn_, torch_ = _first_epoch_losses(tmp_path, *_SGD, *flags)
    assert mpsnn_ == pytest.approx(torch_, rel=1e-6)
    assert plain_sgd[0] == pytest.approx(plain_sgd[1], rel=1e-6)
    assert abs(mpsnn_ - plain_sgd[0]) > 2e-5  # ten times the tolerance above


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--momentum", "0.5"], "Error: --momentum is SGD's momentum (MPS's momentum_scale): "
         "--optimizer adam has none in MPS (Adam's beta1 stays 0.9), got --momentum 0.5 with it; "
         "drop it or use --optimizer sgd"),
        (["--optimizer", "rmsprop", "--momentum", "0.5"], "Error: --momentum is SGD's momentum"),
        (["--optimizer", "sgd", "--momentum", "1"],
         "Error: --momentum must be a number in [0, 1), got 1.0"),
        (["--optimizer", "sgd", "--momentum", "nan"],
         "Error: --momentum must be a number in [0, 1), got nan"),
        (["--weight-decay", "-1"], "Error: --weight-decay must be a finite number >= 0, got -1.0"),
        (["--weight-decay", "inf"], "Error: --weight-decay must be a finite number >= 0, got inf"),
        (["--clip-grad", "0"], "Error: --clip-grad must be a finite number > 0, got 0.0"),
        (["--label-smoothing", "1"], "Error: --label-smoothing must be a number in [0, 1), got 1.0"),
        (["--warmup-epochs", "2", "--epochs", "2"], "Error: --warmup-epochs must be a finite "
         "number >= 0 and less than the run's 2 epochs, got 2.0"),
        (["--warmup-epochs", "-0.5"], "Error: --warmup-epochs must be a finite number >= 0"),
        (["--schedule", "cosine", "--lr-decay", "0.5"], "Error: --lr-decay is the factor of the "
         "exponential and step schedules, got it with --schedule cosine"),
        (["--step-epochs", "3"], "Error: --step-epochs is the period of --schedule step, got it "
         "with --schedule exponential"),
        (["--schedule", "step", "--step-epochs", "0"],
         "Error: Invalid value for '--step-epochs': 0 is not in the range x>=1."),
        (["--schedule", "linear"], "Error: Invalid value for '--schedule': 'linear' is not one of"),
        (["--schedule", "step", "--lr-decay", "1e200", "--epochs", "5"],
         "Error: --lr-decay 1e+200 makes the learning rate of epoch 5 (lr · "
         "decay^floor((epoch-1)/2)) overflow: it must stay finite for every epoch"),
    ],
)  # fmt: skip
@pytest.mark.usefixtures("no_training")
def test_bad_options_are_one_line_before_training(args: list[str], message: str) -> None:
    code, out = _run("train", *SMALL, *args)
    assert code == 2, out
    assert _one_error(out).startswith(message)


# -- resume ------------------------------------------------------------------------------------

FLAGS = ["--optimizer", "sgd", "--schedule", "cosine", "--warmup-epochs", "0.5", "--momentum",
         "0.5", "--weight-decay", "0.001", "--clip-grad", "0.5", "--label-smoothing", "0.1"]  # fmt: skip


def _state(folder: Path) -> list[torch.Tensor]:
    ckpt = m.load(folder / "checkpoint.mpsnn")
    out = []
    for ds in ckpt["data_sources"]:
        out += [ds.weights(), ds.bias_terms()]
        for vectors in (ds.optimizer_state or {}).values():
            out += vectors
    return out


def _killed_after_epoch_1(monkeypatch: pytest.MonkeyPatch, folder: Path, *flags: str) -> None:
    """A 2-epoch run that dies right after writing the checkpoint of epoch 1."""
    save = Trainer.save_checkpoint

    def save_then_die(self: Trainer, where: Path) -> Path:
        save(self, where)
        raise SystemExit(9)

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "save_checkpoint", save_then_die)
        code, out = _run("train", *SMALL, *flags, "--epochs", "2", "--checkpoint-dir", str(folder))
    assert code == 9, out
    assert m.load(folder / "checkpoint.mpsnn")["epoch"] == 1


def test_resume_keeps_the_options_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    code, out = _run("train", *SMALL, *FLAGS, "--epochs", "2", "--checkpoint-dir", str(whole))
    assert code == 0, out
    _killed_after_epoch_1(monkeypatch, split, *FLAGS)
    saved = {k: m.load(split / "checkpoint.mpsnn")["config"][k] for k in ADDED_OPTIONS}
    assert saved == {"schedule": "cosine", "step_epochs": 2, "warmup_epochs": 0.5,
                     "momentum": 0.5, "weight_decay": 0.001, "clip_grad": 0.5,
                     "label_smoothing": 0.1}  # fmt: skip
    for given, name in ((["--schedule", "constant"], "--schedule constant (saved: cosine)"),
                        (["--momentum", "0.9"], "--momentum 0.9 (saved: 0.5)"),
                        (["--clip-grad", "1"], "--clip-grad 1.0 (saved: 0.5)"),
                        (["--label-smoothing", "0"], "--label-smoothing 0.0 (saved: 0.1)"),
                        (["--warmup-epochs", "1"], "--warmup-epochs 1.0 (saved: 0.5)")):  # fmt: skip
        code, out = _run("train", "--resume", "--checkpoint-dir", str(split), *given)
        assert code == 2 and name in _one_error(out), out
    # options given with their saved values are accepted
    code, out = _run("train", "--resume", "--checkpoint-dir", str(split), "--momentum", "0.5",
                     "--schedule", "cosine", "--weight-decay", "0.001")  # fmt: skip
    assert code == 0, out
    assert "resumed after epoch 1" in out
    a, b = _state(whole), _state(split)
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    ha = m.load(whole / "checkpoint.mpsnn")["history"]
    hb = m.load(split / "checkpoint.mpsnn")["history"]
    for key in ("lr", "train_loss", "test_accuracy"):
        assert [r[key] for r in ha] == [r[key] for r in hb], key


def test_a_checkpoint_from_before_the_options_resumes_with_their_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole, old = tmp_path / "whole", tmp_path / "old"
    assert _run("train", *SMALL, "--epochs", "2", "--checkpoint-dir", str(whole))[0] == 0
    _killed_after_epoch_1(monkeypatch, old)
    ckpt = m.load(old / "checkpoint.mpsnn")
    for name in ADDED_OPTIONS:  # as written before these options existed
        del ckpt["config"][name]
    m.save(ckpt, old / "checkpoint.mpsnn")
    code, out = _run("train", "--resume", "--checkpoint-dir", str(old))
    assert code == 0, out
    resumed = m.load(old / "checkpoint.mpsnn")
    assert {k: resumed["config"][k] for k in ADDED_OPTIONS} == ADDED_OPTIONS
    a, b = _state(whole), _state(old)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # an SGD run of then: --momentum 0.9 (its momentum then) is accepted, 0.5 refused
    sgd = tmp_path / "sgd"
    _killed_after_epoch_1(monkeypatch, sgd, "--optimizer", "sgd")
    ckpt = m.load(sgd / "checkpoint.mpsnn")
    for name in ADDED_OPTIONS:
        del ckpt["config"][name]
    m.save(ckpt, sgd / "checkpoint.mpsnn")
    code, out = _run("train", "--resume", "--checkpoint-dir", str(sgd), "--momentum", "0.5")
    assert code == 2 and "--momentum 0.5 (saved: 0.9)" in _one_error(out), out
    code, out = _run("train", "--resume", "--checkpoint-dir", str(sgd), "--momentum", "0.9")
    assert code == 0, out
