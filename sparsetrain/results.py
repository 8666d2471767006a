"""Run-folder files: ``metrics.jsonl`` (appended as training goes) and ``summary.json``.

``summary.json`` is written at the start with ``status: running`` and replaced atomically
(write to a temporary file, then ``os.replace``) with ``completed`` or ``failed``: a reader never
sees a half-written file, and a crashed run never looks finished.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _clean(obj: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every reader can parse the file."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json_atomic(path: str | Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_clean(obj), f, indent=2, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def one_line_error(exc: BaseException) -> str:
    """``Type: first line of the message``: what summary.json and the console show."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def read_summary(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / SUMMARY
    if not path.exists():
        return None
    return json.loads(path.read_text())


def mark_failed(run_dir: str | Path, error: str, **fields: Any) -> None:
    """Record a failure unless the run already recorded its own end (completed or failed)."""
    summary = read_summary(run_dir) or {"run_dir": str(run_dir), "started_at": now_iso()}
    if summary.get("status") in ("completed", "failed"):
        return
    summary.update(fields)
    summary.update(status="failed", error=error, finished_at=now_iso())
    write_json_atomic(Path(run_dir) / SUMMARY, summary)


class RunWriter:
    """Writes one run's files. Only rank 0 holds one; other ranks get ``NullWriter``."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.summary: dict[str, Any] = {}
        self._metrics = None

    def start(self, **fields: Any) -> None:
        self.summary = {"status": "running", "error": None, "started_at": now_iso(), **fields}
        write_json_atomic(self.run_dir / SUMMARY, self.summary)

    def open_metrics(self, keep_records: int | None = None) -> None:
        """Open metrics.jsonl for appending; on resume keep only the first ``keep_records``
        lines (what the checkpoint had seen), dropping records logged after it."""
        path = self.run_dir / METRICS
        if keep_records is not None and path.exists():
            lines = path.read_text().splitlines(keepends=True)[:keep_records]
            path.write_text("".join(lines))
        elif keep_records is None:
            path.write_text("")
        self._metrics = open(path, "a", buffering=1)

    def log(self, record: dict[str, Any]) -> None:
        if self._metrics is None:
            self.open_metrics()
        self._metrics.write(json.dumps(_clean(record)) + "\n")

    def finish(self, status: str, error: str | None = None, **fields: Any) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self.summary.update(fields)
        self.summary.update(status=status, error=error, finished_at=now_iso())
        write_json_atomic(self.run_dir / SUMMARY, self.summary)


class NullWriter:
    """What non-zero ranks hold: every call does nothing, so call sites never test the rank."""

    summary: dict[str, Any] = {}

    def start(self, **fields: Any) -> None: ...
    def open_metrics(self, keep_records: int | None = None) -> None: ...
    def log(self, record: dict[str, Any]) -> None: ...
    def finish(self, status: str, error: str | None = None, **fields: Any) -> None: ...


# A run "did not train" when its final training loss is no better than a uniform guess over the
# classes (ln C, 2.30 for 10 classes): such a run diverged or never left the start, and its
# accuracy says nothing about the scheme. Tables list it apart and never rank it.
DID_NOT_TRAIN = "did not train"


def untrained_reason(summary: dict) -> str | None:
    """Why a completed run counts as not trained (one line), or None when it trained."""
    if summary.get("status") != "completed":
        return None
    classes = summary.get("num_classes") or 10
    loss = summary.get("train_loss")
    bound = math.log(classes)
    if loss is None or not math.isfinite(float(loss)):
        return f"final train loss {loss} is not finite"
    if float(loss) >= bound:
        return f"final train loss {float(loss):.3g} >= ln({classes}) = {bound:.2f}, a uniform guess"
    return None
