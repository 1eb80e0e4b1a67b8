"""What `load` and `save` do with the file itself: only regular files are read, the header is
checked before any tensor data is read, tensors are read straight into their own memory and
written from theirs (peak memory about the file's size once), non-finite JSON numbers are
refused, and the temporary files of saves killed midway are removed by the next save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

import mpsnn as m
import mpsnn.io.files as files
from tests.io._helpers import ROOT, _parts, _write


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


# -- what load reads ---------------------------------------------------------------------------


def test_load_refuses_a_symlink_to_dev_zero_at_once(tmp_path: Path) -> None:
    """(Reading the path whole would never end: run in a process that a deadline stops.)"""
    link = tmp_path / "checkpoint.mpsnn"
    link.symlink_to("/dev/zero")
    done = _python(f"""
        import mpsnn
        try:
            mpsnn.load({str(link)!r})
        except mpsnn.CheckpointError as exc:
            print(exc)
    """, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[load] the path must name a regular file, got a character device"


def test_load_refuses_directories_and_pipes(tmp_path: Path) -> None:
    with pytest.raises(m.CheckpointError, match=r"^\[load\] the path must name a regular file, got a directory$"):  # fmt: skip
        m.load(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening it for reading must not wait for a writer
    with pytest.raises(m.CheckpointError, match=r"got a pipe$"):
        m.load(fifo)


def test_the_header_is_checked_before_any_tensor_is_read(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    structure, tensors = _parts(saved)
    structure["objects"][0]["type"] = "Pickle"
    _write(saved, structure, tensors)
    reads: list[str] = []
    monkeypatch.setattr(files.SafetensorsFile, "read", lambda self, name: reads.append(name))
    with pytest.raises(m.CheckpointError, match="type must be a registered type"):
        m.load(saved)
    assert reads == []


def test_tensors_must_tile_the_data(tmp_path: Path) -> None:
    """Two tensors over the same bytes (a file safetensors itself refuses)."""
    path = tmp_path / "overlap.safetensors"
    m.save({"a": torch.ones(2), "b": torch.zeros(2)}, path)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    names = [k for k in header if k != "__metadata__"]
    header[names[1]]["data_offsets"] = header[names[0]]["data_offsets"]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n : 8 + n + 8])
    with pytest.raises(m.CheckpointError, match=r"the tensors must tile the data without gaps or overlaps, got tensor"):  # fmt: skip
        m.load(path)


def test_a_file_that_shrinks_while_it_is_read(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.preadv

    def short(fd: int, buffers: list, offset: int) -> int:
        return 0 if offset >= 8 + int.from_bytes(saved.read_bytes()[:8], "little") else real(fd, buffers, offset)  # fmt: skip

    monkeypatch.setattr(os, "preadv", short)
    with pytest.raises(m.CheckpointError, match=r"while it is read, got \d+ \(it was truncated\)"):
        m.load(saved)


# -- non-finite numbers -----------------------------------------------------------------------


@pytest.mark.parametrize("number", ["1e999", "-1e999", "1E400"])
def test_json_numbers_that_overflow_are_refused(saved: Path, number: str) -> None:
    """The format's numbers are finite (non-finite floats are ``$float`` tags): ``1e999``
    would parse as inf."""
    structure, tensors = _parts(saved)
    text = json.dumps(structure).replace('"epoch": 3', f'"epoch": {number}')
    assert number in text
    safetensors.torch.save_file(tensors, saved, metadata={"mpsnn": text})
    with pytest.raises(
        m.CheckpointError,
        match=rf"\[load\] the 'mpsnn' metadata must be JSON, got {number} is not a finite number",
    ):
        m.load(saved)


def test_tagged_non_finite_floats_still_load(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    m.save({"x": [float("inf"), -float("inf"), 1e308]}, path)
    x = m.load(path)["x"]
    assert x[:2] == [float("inf"), -float("inf")] and x[2] == 1e308


# -- what save writes --------------------------------------------------------------------------


def test_save_writes_any_layout_and_safetensors_reads_it(tmp_path: Path) -> None:
    """Strided views, 0-dim and empty tensors, every dtype, written in chunks smaller than
    some tensors: the file is a safetensors file with the same values."""
    chunk = files._CHUNK
    files._CHUNK = 64  # bytes: every strided tensor below spans several chunks
    try:
        g = torch.Generator().manual_seed(0)
        base = torch.randn(12, 10, generator=g, dtype=torch.float64)
        values = {
            "strided": base[:, ::3],
            "transposed": base.t(),
            "rows": torch.randn(3, 40, generator=g)[:, 1:],  # rows longer than a chunk
            "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
            "empty": torch.zeros(0, 3, dtype=torch.int16),
            "bytes": torch.arange(7, dtype=torch.uint8),
            "flags": torch.tensor([True, False, True]),
            "halves": torch.randn(5, generator=g).half()[::2],
            "ints": torch.arange(-4, 4, dtype=torch.int64).view(2, 4).t(),
        }
        path = tmp_path / "layouts.safetensors"
        m.save(values, path)
    finally:
        files._CHUNK = chunk
    back = m.load(path)
    for name, t in values.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
        assert back[name].is_contiguous() and back[name].untyped_storage().resizable()
    structure, raw = _parts(path)  # the safetensors library reads the file too
    refs = structure["root"]["$dict"]
    assert len(raw) == len(values)
    for name, t in values.items():
        assert torch.equal(raw[refs[name]["$tensor"]], t), name


def test_save_leaves_the_saved_tensors_as_they_were(tmp_path: Path) -> None:
    t = torch.randn(5)
    m.save({"t": t}, tmp_path / "t.safetensors")
    assert t.untyped_storage().resizable()  # no NumPy view was taken of it


_MEASURE = """
    import json, sys, torch, mpsnn

    def peak():  # kB
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024

    def reset():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    mode, path, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
    n = mb * 2**20 // 24  # bytes per n: 8 + 2 + 8 + 2 + 4
    if mode == "save":
        g = torch.Generator().manual_seed(0)
        obj = {"a": torch.randn(2 * n, generator=g), "b": torch.randn(n, generator=g).half(),
               "c": torch.randn(n, 2, generator=g).t(), "d": [torch.randn(n // 2, generator=g)],
               "e": torch.randn(n, 4, generator=g)[:, :2].to(torch.bfloat16)}
        reset(); before = peak()
        mpsnn.save(obj, path)
    else:
        reset(); before = peak()
        obj = mpsnn.load(path)
    print(json.dumps({"grew": peak() - before}))
"""


def _peak(mode: str, path: Path, mb: int) -> int:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_MEASURE), mode, str(path),
                           str(mb)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["grew"]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_save_and_load_need_the_files_size_once(tmp_path: Path) -> None:
    """A ~100 MB checkpoint: load grows the peak resident memory by at most 1.3x the file
    (the loaded tensors are the file's size), save by at most 0.3x (the saved objects are
    already in memory) — plus 24 MiB for the interpreter's own allocations."""
    path = tmp_path / "big.safetensors"
    saved = _peak("save", path, 100)
    size = path.stat().st_size
    assert size > 90 * 2**20
    loaded = _peak("load", path, 100)
    slack = 24 * 2**20
    assert saved <= 0.3 * size + slack, (saved / size, size)
    assert loaded <= 1.3 * size + slack, (loaded / size, size)


# -- temporary files of dead saves --------------------------------------------------------------


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_save_removes_the_temporary_files_of_dead_saves(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint.mpsnn"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "dead": f".checkpoint.mpsnn.{_dead_pid()}.0123456789abcdef.tmp",
            "live": f".checkpoint.mpsnn.{live.pid}.0123456789abcdef.tmp",
            "old legacy": ".checkpoint.mpsnn.fedcba9876543210.tmp",
            "new legacy": ".checkpoint.mpsnn.00000000000000ff.tmp",
            "other target": f".other.mpsnn.{_dead_pid()}.0123456789abcdef.tmp",
            "not ours": f".checkpoint.mpsnn.{_dead_pid()}.notours.tmp",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"partial")
        hours_ago = time.time() - 2 * files.LEGACY_TEMPORARY_AGE
        os.utime(tmp_path / names["old legacy"], (hours_ago, hours_ago))
        m.save({"epoch": 1}, target)
        left = {p.name for p in tmp_path.iterdir()}
    finally:
        live.kill()
        live.wait()
    kept = {"live", "new legacy", "other target", "not ours"}
    assert left == {"checkpoint.mpsnn"} | {names[k] for k in kept}
    assert m.load(target) == {"epoch": 1}


def test_a_save_killed_midway_leaves_a_file_the_next_save_removes(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint.mpsnn"
    m.save({"epoch": 1}, target)
    done = _python(f"""
        import os, signal, torch, mpsnn, mpsnn.io.files as files
        real = files._write_all
        def write_then_die(fd, data):
            real(fd, data)
            os.kill(os.getpid(), signal.SIGKILL)
        files._write_all = write_then_die
        mpsnn.save({{"epoch": 2, "w": torch.zeros(1000)}}, {str(target)!r})
    """)  # fmt: skip
    assert done.returncode == -signal.SIGKILL
    stray = [p for p in tmp_path.iterdir() if p.name != "checkpoint.mpsnn"]
    assert len(stray) == 1 and stray[0].name.startswith(".checkpoint.mpsnn.")
    assert m.load(target) == {"epoch": 1}  # the previous file is intact
    m.save({"epoch": 3}, target)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.mpsnn"]


def test_resume_removes_them_too(tmp_path: Path) -> None:
    from mpsnn.cli.runs import CHECKPOINT
    from mpsnn.cli.trainer import Trainer

    stale = tmp_path / f".{CHECKPOINT}.{_dead_pid()}.0123456789abcdef.tmp"
    stale.write_bytes(b"partial")
    m.save({"kind": "not a training run"}, tmp_path / "other.mpsnn")  # nothing to resume
    (tmp_path / CHECKPOINT).symlink_to(tmp_path / "other.mpsnn")
    with pytest.raises(Exception, match="must be a checkpoint written by mpsnn train"):
        Trainer.resume(tmp_path)
    assert not stale.exists()


def test_this_process_keeps_the_file_of_its_own_save_in_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    target = Path("checkpoint.mpsnn")  # relative: the files are listed as ./.checkpoint...
    fd, tmp = files._create_temporary(target)
    try:
        assert files.remove_stale_temporary_files(target) == []
    finally:
        os.close(fd)
        with files._lock:
            files._in_progress.discard(os.path.abspath(tmp))
    assert files.remove_stale_temporary_files(target) == [tmp]
