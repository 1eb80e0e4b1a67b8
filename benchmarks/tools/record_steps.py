"""Record 20 training steps of the model zoo exactly, and compare two recordings bit for bit.

Each workload is a model (LeNet-5, Apple's MNIST network, ResNet-18 on 32×32×3 images), a
storage format of the graph's intermediates (float32, bfloat16) and a way to run the steps:

- ``eager``: ``graph.encode_batch`` on a new command buffer per step, committed and waited for;
- ``replay``: ``graph.compile()`` once, the compiled graph called per step (recorded at the
  second step and replayed from the third on CUDA; every step eager on the CPU).

The inputs are synthetic: fixed-seed images and labels made on the CPU, then moved to the
device (raw bytes for Apple's network, which reads UNORM8 images as the sample does). A record
holds every step's loss image as raw bytes (hex), and after the last step a SHA-256 of every
data source's weights, biases, gamma, beta and running statistics, and of the last step's
logits. Two recordings of the same code on the same machine must be identical; a change to
the execution layer that keeps the arithmetic must keep them identical too.

    python benchmarks/tools/record_steps.py --device cpu --out records.json
    python benchmarks/tools/record_steps.py --device cpu --compare records.json
    python benchmarks/tools/record_steps.py --device cuda --only resnet18/bfloat16 --compare r.json

``--compare FILE`` runs the workloads and prints, per workload, ``identical`` or the first step
whose loss differs and the tensors that differ; the exit status is 1 on any difference.
``--only`` keeps the workloads whose name (``model/storage/mode``) contains one of its
comma-separated parts. The tool imports ``mpsnn`` from ``sys.path`` as Python finds it, so
``PYTHONPATH=old/tree python benchmarks/tools/record_steps.py ...`` records an older tree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

STEPS = 20
MODELS = ("lenet", "apple-mnist", "resnet18")
STORAGES = ("float32", "bfloat16")
MODES = ("eager", "replay")
#: batch sizes: small on the CPU (the whole CPU recording takes seconds), larger on CUDA
BATCH = {
    "cpu": {"lenet": 8, "apple-mnist": 8, "resnet18": 2},
    "cuda": {"lenet": 64, "apple-mnist": 32, "resnet18": 16},
}
#: the CPU recording runs on this many threads, whatever the machine: PyTorch's CPU kernels
#: split reductions by thread (2 threads give other bits than 1 from the second step on), and a
#: record is only comparable under the same split. Records are also specific to the CPU's
#: vector instructions (``meta.cpu_capability``) and to the GPU model (``meta.device_name``).
CPU_THREADS = 1


@dataclass(frozen=True)
class Workload:
    model: str
    storage: str
    mode: str

    @property
    def name(self) -> str:
        return f"{self.model}/{self.storage}/{self.mode}"


WORKLOADS = [Workload(m, s, mode) for m in MODELS for s in STORAGES for mode in MODES]


def select(only: str | None) -> list[Workload]:
    """The workloads whose name contains one of ``only``'s comma-separated parts (all: None)."""
    if not only:
        return list(WORKLOADS)
    parts = [p for p in only.split(",") if p]
    chosen = [w for w in WORKLOADS if any(p in w.name for p in parts)]
    if not chosen:
        names = ", ".join(w.name for w in WORKLOADS)
        raise ValueError(f"[record_steps] --only must match some of {names}, got {only!r}")
    return chosen


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` in its own dtype (bfloat16 included), row-major, on the host."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def _model(name: str, dev: Any) -> Any:
    """The model with seed-0 weights and its optimizer (one per model, shared by its layers):
    Adam (rate 1e-3) for LeNet-5 and Apple's network, SGD (rate 0.05, momentum 0.9) for
    ResNet-18, as ``mpsnn bench`` trains them."""
    import mpsnn as m
    from mpsnn.models import AppleMNIST, LeNet5, ResNet18

    if name == "resnet18":
        opt = m.SGD(dev, momentum_scale=0.9, descriptor=m.OptimizerDescriptor(learning_rate=0.05))
        return ResNet18(dev, opt, seed=0, input_shape=(3, 32, 32))
    opt = m.Adam(dev, descriptor=m.OptimizerDescriptor(learning_rate=1e-3))
    cls = LeNet5 if name == "lenet" else AppleMNIST
    return cls(dev, opt, seed=0)


def _data(model: str, net: Any, batch: int, torch_device: torch.device) -> list[tuple]:
    """``STEPS`` batches of images and labels, made on the CPU from a seed of the model's and
    moved to ``torch_device``: standard normal images (uint8 bytes for Apple's network), labels
    ``(N, 1, 1)`` class indices."""
    gen = torch.Generator().manual_seed(1000 + MODELS.index(model))
    out = []
    for _ in range(STEPS):
        shape = (batch, *net.input_shape)
        if model == "apple-mnist":
            x = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        else:
            x = torch.randn(shape, generator=gen)
        y = torch.randint(0, net.classes, (batch, 1, 1), generator=gen)
        out.append((x.to(torch_device), y.to(torch_device)))
    return out


def _source_tensors(net: Any) -> list[tuple[str, torch.Tensor]]:
    """Every data source's values after training, named ``index.kind.field``."""
    import mpsnn as m

    out = []
    for i, ds in enumerate(net.data_sources):
        if isinstance(ds, m.TensorBatchNormalizationDataSource):
            fields = ("gamma", "beta", "mean", "variance")
            out += [(f"{i:02d}.bn.{f}", getattr(ds, f)()) for f in fields]
        else:
            out.append((f"{i:02d}.conv.weights", ds.weights()))
            bias = ds.bias_terms()
            if bias is not None:
                out.append((f"{i:02d}.conv.biases", bias))
    return out


def run(work: Workload, device: str) -> dict[str, Any]:
    """Train ``work`` for ``STEPS`` steps on ``device``; its record (see the module docstring)."""
    import mpsnn as m

    dev = m.Device(device)
    batch = BATCH["cuda" if device.startswith("cuda") else "cpu"][work.model]
    net = _model(work.model, dev)
    graph = net.training_graph(batch, storage=m.FeatureChannelFormat[work.storage.upper()])
    data = _data(work.model, net, batch, dev.torch_device)
    queue = dev.new_command_queue()
    compiled = graph.compile(queue) if work.mode == "replay" else None
    losses: list[str] = []
    loss_meta: dict[str, Any] = {}
    for x, y in data:
        images, labels = [m.ImageBatch.from_tensor(x)], [m.LossLabels(dev, y)]
        if compiled is None:
            cb = queue.command_buffer()
            graph.encode_batch(cb, images, labels)
            cb.commit()
            cb.wait_until_completed()
            loss = labels[0].loss_image().tensor
        else:
            compiled(images, labels)
            compiled.wait_until_completed()
            loss = compiled.source_states[0][0].loss_image().tensor  # the static labels' loss
        losses.append(tensor_bytes(loss).hex())
        loss_meta = {"dtype": str(loss.dtype).removeprefix("torch."), "shape": list(loss.shape)}
    logits = graph.intermediate_images[0].tensor
    record: dict[str, Any] = {
        "batch": batch,
        "loss": loss_meta,
        "losses": losses,
        "weights": {name: sha256(t) for name, t in _source_tensors(net)},
        "logits": {
            "dtype": str(logits.dtype).removeprefix("torch."),
            "shape": list(logits.shape),
            "sha256": sha256(logits),
        },
    }
    if compiled is not None:
        record["replays"] = compiled.replays
    return record


def _prepare(device: str) -> None:
    if device.startswith("cuda"):
        # The comparison must not see cuDNN's nondeterministic algorithms: its default
        # weight-gradient convolutions may sum in a different order from run to run, and its
        # autotuner may pick another algorithm in another process. mpsnn's own float32
        # precision setting is left at its default, the setting the library runs with.
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    else:
        torch.set_num_threads(CPU_THREADS)


def record(device: str, only: str | None = None, log: Any = None) -> dict[str, Any]:
    """Run the selected workloads on ``device``; ``{"meta": ..., "records": {name: ...}}``."""
    import mpsnn

    _prepare(device)
    records = {}
    for work in select(only):
        start = time.perf_counter()
        try:
            records[work.name] = run(work, device)
        except Exception as exc:  # one broken workload must not hide the others
            records[work.name] = {"error": f"{type(exc).__name__}: {exc}"}
        if log is not None:
            took = f"{time.perf_counter() - start:7.2f} s"
            error = records[work.name].get("error")
            print(f"{work.name:<28} {took}" + (f"  FAILED: {error}" if error else ""), file=log,
                  flush=True)  # fmt: skip
    meta = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "mpsnn": os.path.dirname(os.path.abspath(mpsnn.__file__)),
        "float32_matmul_precision": mpsnn.get_float32_matmul_precision(),
        "steps": STEPS,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
    }
    return {"meta": meta, "records": records}


def _floats(hexed: str, dtype: str) -> list[float]:
    raw = bytes.fromhex(hexed)
    if dtype == "float32":
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    if dtype == "bfloat16":  # the high half of a float32
        return [struct.unpack("<f", b"\0\0" + raw[i : i + 2])[0] for i in range(0, len(raw), 2)]
    return [float(b) for b in raw]


def differences(ref: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two records of one workload (empty: identical): a failed run, or
    the first step whose loss differs, then every differing tensor."""
    if "error" in new or "error" in ref:
        return [f"run failed: {r['error']}" for r in (ref, new) if "error" in r]
    out = []
    for key in ("batch", "loss"):
        if ref.get(key) != new.get(key):
            out.append(f"{key}: {ref.get(key)} != {new.get(key)}")
    dtype = (ref.get("loss") or {}).get("dtype", "float32")
    for step, (a, b) in enumerate(zip(ref["losses"], new["losses"], strict=False), start=1):
        if a != b:
            fa, fb = _floats(a, dtype)[:4], _floats(b, dtype)[:4]
            out.append(f"loss differs first at step {step}: recorded {fa}, got {fb} (first values)")
            break
    if len(ref["losses"]) != len(new["losses"]):
        out.append(f"steps: {len(ref['losses'])} != {len(new['losses'])}")
    wa, wb = ref["weights"], new["weights"]
    for key in sorted(wa.keys() | wb.keys()):
        if wa.get(key) != wb.get(key):
            out.append(f"weights {key} differ" if key in wa and key in wb else f"{key}: missing")
    if ref["logits"] != new["logits"]:
        out.append("last step's logits differ")
    return out


def compare(reference: dict[str, Any], current: dict[str, Any], log: Any = sys.stdout) -> bool:
    """Print each workload of ``current`` as identical to ``reference`` or what differs;
    True when all are identical."""
    same = True
    for name, new in current["records"].items():
        ref = reference["records"].get(name)
        diffs = ["not in the reference file"] if ref is None else differences(ref, new)
        same = same and not diffs
        print(f"{name:<28} {'identical' if not diffs else 'DIFFERS'}", file=log)
        for d in diffs:
            print(f"    {d}", file=log)
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", default=None, help="write the records here (JSON)")
    parser.add_argument("--compare", default=None, help="compare with the records in this file")
    parser.add_argument("--only", default=None, help="comma-separated parts of workload names")
    args = parser.parse_args(argv)
    import mpsnn

    print(f"# mpsnn from {os.path.dirname(os.path.abspath(mpsnn.__file__))}", flush=True)
    start = time.perf_counter()
    result = record(args.device, args.only, log=sys.stdout)
    print(f"# {len(result['records'])} workloads in {time.perf_counter() - start:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
            f.write("\n")
    failed = any("error" in r for r in result["records"].values())
    if args.compare:
        with open(args.compare) as f:
            reference = json.load(f)
        if not compare(reference, result):
            return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
