"""The results files of `benchmarks.suite` and the comparison with a baseline: where a
device's baseline lives, the schema every results file is validated against, the status of
each row against its baseline row (regressed, improved, drift, ok, new, missing), the better
of two runs of a regressed group, an updated baseline's rows, and the printed table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA = 1
TOLERANCE = 0.05

#: keys every row has (besides extras of its group)
ROW_KEYS = {
    "group": str,
    "name": str,
    "mpsnn_ms": float,
    "pytorch_ms": float,
    "ratio": float,
    "dtype": str,
    "precision": dict,
    "device": str,
    "torch": str,
    "triton": (str, type(None)),
    "date": str,
    "commit": (str, type(None)),
}
#: keys of the whole results file
DOC_KEYS = {
    "schema": int,
    "device": str,
    "slug": str,
    "quick": bool,
    "torch": str,
    "triton": (str, type(None)),
    "date": str,
    "commit": (str, type(None)),
    "rows": list,
}


def baseline_path(results_dir: Path, device_slug: str, quick: bool) -> Path:
    """Where a device's baseline lives (``--quick`` runs have their own)."""
    return Path(results_dir) / f"{device_slug}{'-quick' if quick else ''}.json"


def validate(doc: Any) -> None:
    """Raise ``ValueError`` unless ``doc`` is a results file of this schema."""

    def check(obj: Any, keys: dict[str, Any], what: str) -> None:
        if not isinstance(obj, dict):
            raise ValueError(f"[suite] {what} must be an object, got {type(obj).__name__}")
        for k, t in keys.items():
            if k not in obj:
                raise ValueError(f"[suite] {what} must have {k!r}, got keys {sorted(obj)}")
            wrong_bool = isinstance(obj[k], bool) and t is not bool  # bool is an int
            if wrong_bool or not isinstance(obj[k], t):
                raise ValueError(f"[suite] {what}'s {k!r} must be {t}, got {obj[k]!r}")

    check(doc, DOC_KEYS, "the results file")
    if doc["schema"] != SCHEMA:
        raise ValueError(f"[suite] schema must be {SCHEMA}, got {doc['schema']!r}")
    names = set()
    for i, row in enumerate(doc["rows"]):
        check(row, ROW_KEYS, f"row {i}")
        if not row["ratio"] > 0:
            raise ValueError(f"[suite] row {row['name']!r}: ratio must be > 0, got {row['ratio']}")
        if row["name"] in names:
            raise ValueError(f"[suite] row names must be unique, got {row['name']!r} twice")
        names.add(row["name"])


def load(path: Path) -> dict[str, Any] | None:
    """The results file at ``path`` (validated), or None when there is none."""
    if not Path(path).exists():
        return None
    doc = json.loads(Path(path).read_text())
    validate(doc)
    return doc


def compare_rows(
    new: list[dict[str, Any]], old: list[dict[str, Any]], tolerance: float = TOLERANCE
) -> list[dict[str, Any]]:
    """One entry per row name of either list, new rows first, with ``ratio_change`` and
    ``mpsnn_change`` (relative changes of the ratio and of mpsnn's time) and a ``status``:

    * "regressed": the ratio AND mpsnn's time both grew by more than the tolerance;
    * "improved": both shrank by more;
    * "drift": one of them moved by more, the other did not follow: PyTorch's side or the
      host changed, not mpsnn (reported, not a regression);
    * "ok", "new" (no baseline row), "missing" (in the baseline, not in this run).

    The tolerance is ``tolerance`` or the row's own ``tolerance``, whichever is larger."""
    before = {r["name"]: r for r in old}
    out = []
    for r in new:
        o = before.get(r["name"])
        entry = {"name": r["name"], "group": r["group"], "ratio": r["ratio"],
                 "mpsnn_ms": r["mpsnn_ms"], "pytorch_ms": r["pytorch_ms"]}  # fmt: skip
        if o is None:
            out.append({**entry, "status": "new"})
            continue
        tol = max(tolerance, r.get("tolerance", 0.0))
        change = r["ratio"] / o["ratio"] - 1
        mpsnn_change = r["mpsnn_ms"] / o["mpsnn_ms"] - 1
        if change > tol and mpsnn_change > tol:
            status = "regressed"
        elif change < -tol and mpsnn_change < -tol:
            status = "improved"
        elif max(abs(change), abs(mpsnn_change)) > tol:
            status = "drift"
        else:
            status = "ok"
        out.append({**entry, "status": status, "baseline_ratio": o["ratio"],
                    "ratio_change": change, "mpsnn_change": mpsnn_change})  # fmt: skip
    seen = {r["name"] for r in new}
    out += [{"name": o["name"], "group": o["group"], "status": "missing",
             "baseline_ratio": o["ratio"]} for o in old if o["name"] not in seen]  # fmt: skip
    return out


def keep_better(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``first`` with each row that ``second`` measured again replaced by the run of the two
    with the lower ratio (marked ``runs: 2``)."""
    again = {r["name"]: r for r in second}
    out = []
    for r in first:
        s = again.get(r["name"])
        out.append(r if s is None else {**min(r, s, key=lambda x: x["ratio"]), "runs": 2})
    return out


def merged_baseline(
    new: list[dict[str, Any]], old: list[dict[str, Any]], groups: list[str]
) -> list[dict[str, Any]]:
    """The rows of an updated baseline: this run's, then the old rows of groups it did not
    run (``--only``); old rows of the groups it ran are dropped."""
    return new + [r for r in old if r["group"] not in groups]


# -- output ----------------------------------------------------------------------------------


def table(comparison: list[dict[str, Any]]) -> str:
    """The short table printed last."""

    def pct(v: float | None) -> str:
        return "" if v is None else f"{100 * v:+.1f}%"

    width = max([len(c["name"]) for c in comparison] + [4])
    lines = [f"{'row':{width}}  {'mpsnn ms':>9} {'torch ms':>9} {'ratio':>6} {'base':>6} "
             f"{'d ratio':>8} {'d mpsnn':>8}  status"]  # fmt: skip
    for c in comparison:
        base = c.get("baseline_ratio")
        if "ratio" in c:
            nums = f"{c['mpsnn_ms']:9.3f} {c['pytorch_ms']:9.3f} {c['ratio']:6.3f}"
        else:
            nums = f"{'':9} {'':9} {'':6}"
        lines.append(
            f"{c['name']:{width}}  {nums} {'' if base is None else f'{base:.3f}':>6} "
            f"{pct(c.get('ratio_change')):>8} {pct(c.get('mpsnn_change')):>8}  "
            f"{c['status'].upper() if c['status'] == 'regressed' else c['status']}"
        )
    return "\n".join(lines)


def baseline_notes(
    base_file: Path, baseline: dict[str, Any] | None, env: dict[str, Any], tolerance: float
) -> list[str]:
    """The printed lines that name the baseline compared with (or say there is none), and
    that a PyTorch version other than this run's made it."""
    if baseline is None:
        return [f"# no baseline at {base_file}: nothing to compare with"]
    notes = [f"# baseline: {base_file} (commit {baseline['commit']}, {baseline['date']}, torch "
             f"{baseline['torch']}); regressed: the ratio (mpsnn / torch) and mpsnn's time both "
             f"more than {100 * tolerance:.0f}% above the baseline's"]  # fmt: skip
    if baseline["torch"] != env["torch"]:
        notes.append(f"# note: the baseline ran torch {baseline['torch']}, this run {env['torch']}")
    return notes
