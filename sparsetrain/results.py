"""Run-folder files: ``metrics.jsonl`` (appended as training goes) and ``summary.json``.

``summary.json`` is written at the start with ``status: running`` and replaced atomically
(write to a temporary file, then ``os.replace``) with ``completed`` or ``failed``: a reader never
sees a half-written file, and a crashed run never looks finished.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sparsetrain import scheme_catalog  # plain yaml, no torch
from sparsetrain.errors import (
    RunFolderInUse,
    one_line_error,  # noqa: F401  (the one formatter; re-exported)
)

SUMMARY = "summary.json"
# summary.json's layout (its ``schema_version``): 1 added ``schema_version`` and
# ``compressor_code``; a summary without the field is version 0 (the analysis reads both)
SCHEMA_VERSION = 1
# The phases of a step, as ``time_ms`` in summary.json and metrics.jsonl names them
# (sparsetrain.timing times them; the analysis reads them).
PHASES = ("data", "forward", "backward", "compress", "exchange", "decompress", "optimizer", "step")
METRICS = "metrics.jsonl"
HEARTBEAT = "heartbeat.json"
# Each test image's class as the final evaluation predicted it (rank 0's model, the model that
# test_accuracy scores), beside its label, in the test set's order: an .npz of two arrays,
# ``predicted`` and ``label``, uint8 where the classes fit (int32 otherwise). Written by rank 0
# after training (no random number is drawn for it); read by ``read_test_predictions``.
TEST_PREDICTIONS = "test_predictions.npz"
# Rank 0 rewrites heartbeat.json from a thread while a run trains: at most every
# HEARTBEAT_MIN_S when the step moved on, at least every HEARTBEAT_EVERY_S (long evaluations and
# checkpoints keep beating). A run still marked running whose heartbeat is older than
# HEARTBEAT_STALE_S has died without a word (SIGKILL, OOM killer, lost node).
HEARTBEAT_MIN_S = 5.0
HEARTBEAT_EVERY_S = 15.0
HEARTBEAT_STALE_S = 300.0


def logged_step(steps_done: int, log_every: int) -> bool:
    """Whether the trainer logs a step record once ``steps_done`` steps have run: every
    ``train.log_every`` steps, and after the first. The reducer computes its compression
    statistics on exactly these steps (``TrainStep(want_stats=...)``); ``log_every`` <= 0: never.

    >>> [n for n in range(1, 11) if logged_step(n, 4)]
    [1, 4, 8]
    """
    return log_every > 0 and (steps_done % log_every == 0 or steps_done == 1)


# A run's stability, from its final numbers and its batch losses from this step on (the first
# steps of a fresh network sit near ln C and are not a blow-up).
STABILITY_FROM_STEP = 20
MIN_TRAINED_ACCURACY = 0.20
TRAINED_THROUGHOUT, BLEW_UP_RECOVERED, DID_NOT_TRAIN = (
    "trained throughout", "blew up, recovered", "did not train")
# A blow-up (docs/stability.md) is a batch loss, from step STABILITY_FROM_STEP on, above
# SPIKE_LEVEL x ln C, or above ln C and SPIKE_RISE x the lowest loss recorded before it. A rise
# just past ln C while the network has not yet learned (top-k layer-wise: 2.6 at steps 21-24 from
# about 2.4) is an early blip; block-k global's 10-14 at steps 40-70, or random-k global back at
# 4.5 from 1.2, is a spike.
SPIKE_LEVEL = 2.0
SPIKE_RISE = 2.0


def is_spike(loss: float | None, lowest_before: float | None = None, num_classes: int = 10) -> bool:
    """Whether a batch loss is a blow-up: above ``SPIKE_LEVEL`` x ln(classes), or above ln(classes)
    and ``SPIKE_RISE`` x ``lowest_before`` (the lowest loss recorded before it; None: not known).

    >>> is_spike(2.6, 2.4), is_spike(4.7), is_spike(2.7, 1.1), is_spike(2.2, 0.5)
    (False, True, True, False)
    """
    if loss is None or math.isnan(loss):
        return False
    bound = math.log(num_classes)
    if loss > SPIKE_LEVEL * bound:
        return True
    return lowest_before is not None and loss > bound and loss > SPIKE_RISE * lowest_before


def blow_up(peak_loss: float | None, peak_step: int | None = None, logged: list | tuple = (),
            num_classes: int = 10) -> tuple[int | None, float, float | None] | None:
    """The first blow-up (``is_spike``) among the recorded losses from step ``STABILITY_FROM_STEP``
    on: the run's largest (``peak_loss`` at ``peak_step``, summary.json's ``train_loss_peak``) and
    each logged step's (``logged``: (step, loss) pairs, metrics.jsonl's step records). Each is
    held against the lowest logged loss at an earlier step (the logged steps are every
    ``train.log_every``-th, so that lowest is an upper bound: the rule errs towards "blip").
    Returns (step, loss, lowest before) or None."""
    logged = sorted((int(step), float(loss)) for step, loss in logged
                    if loss is not None and not math.isnan(float(loss)))

    def lowest(before: int | None) -> float | None:
        earlier = [loss for step, loss in logged if before is None or step < before]
        return min(earlier) if earlier and before is not None else None

    candidates = [(step, loss) for step, loss in logged if step >= STABILITY_FROM_STEP]
    if peak_loss is not None:
        candidates.append((peak_step, float(peak_loss)))
    for step, loss in sorted(candidates, key=lambda c: (c[0] is None, c[0] or 0)):
        if is_spike(loss, lowest(step), num_classes):
            return step, loss, lowest(step)
    return None


def stability_of(final_train_loss: float | None, test_accuracy: float | None,
                 peak_loss: float | None, num_classes: int = 10, peak_step: int | None = None,
                 logged: list | tuple = ()) -> str:
    """``did not train`` (``untrained_why``: final train loss not below a uniform guess, or test
    accuracy below 20 %), ``blew up, recovered`` (trained, but a batch loss from step 20 on blew
    up: ``blow_up`` over the largest, ``peak_loss`` at ``peak_step``, and the ``logged`` steps'),
    or ``trained throughout``.

    >>> stability_of(0.3, 0.9, 1.2), stability_of(0.3, 0.9, 7.9), stability_of(0.3, 0.15, 1.0)
    ('trained throughout', 'blew up, recovered', 'did not train')
    >>> stability_of(0.3, 0.9, 2.6, peak_step=21, logged=[(1, 2.4), (20, 2.5)])  # an early blip
    'trained throughout'
    >>> stability_of(0.3, 0.9, 4.5, peak_step=140, logged=[(1, 2.4), (120, 1.2)])  # back from 1.2
    'blew up, recovered'
    """
    if untrained_why(final_train_loss, test_accuracy, num_classes):
        return DID_NOT_TRAIN
    if blow_up(peak_loss, peak_step, logged, num_classes) is not None:
        return BLEW_UP_RECOVERED
    return TRAINED_THROUGHOUT


def logged_losses(path: str | Path) -> list[tuple[int, float]]:
    """(step, train loss) of every step record in a ``metrics.jsonl`` (none: no file); a line
    that does not parse (a run killed mid-write) is skipped."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and r.get("kind") == "step" and isinstance(r.get("train_loss"), (int, float)) \
                and isinstance(r.get("step"), int):
            out.append((r["step"], float(r["train_loss"])))
    return out


def relative_run_dir(run_dir: str | Path) -> str:
    """The run folder relative to the working directory when it lies under it (a study run from
    a checkout names ``results/<study>/N``, not the machine's absolute path), else absolute."""
    path = Path(run_dir).resolve()
    try:
        return path.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.as_posix()


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
        # mkstemp makes the file private (0600); a run folder's files are as readable as any
        # other file the user writes (umask), so collaborators on a shared cluster can read them.
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "w") as f:
            json.dump(_clean(obj), f, indent=2, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it; set straight back, once, at import (no threads yet)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def echo(line: str) -> None:
    """Print a line on stdout through tqdm: an open progress bar is cleared first and redrawn
    after, so a log line never lands inside the bar's line on a terminal."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def read_summary(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / SUMMARY
    if not path.exists():
        return None
    return json.loads(path.read_text())


def mark_failed(run_dir: str | Path, error: str, **fields: Any) -> None:
    """Record a failure unless the run already recorded its own end (completed or failed)."""
    summary = read_summary(run_dir) or {"schema_version": SCHEMA_VERSION, "run_dir": relative_run_dir(run_dir),
                                        "started_at": now_iso()}
    if summary.get("status") in ("completed", "failed"):
        return
    summary.update(fields)
    summary.update(status="failed", error=error, finished_at=now_iso())
    write_json_atomic(Path(run_dir) / SUMMARY, summary)


def holds_a_run(run_dir: str | Path) -> bool:
    """Whether the folder holds a run that trained (or is training): completed, running, failed
    after some steps, or with a checkpoint to resume. An earlier refusal is not one."""
    old = read_summary(run_dir)
    return old is not None and (old.get("status") != "failed" or old.get("steps") is not None
                                or (Path(run_dir) / "checkpoint.pt").exists())


def record_refusal(run_dir: str | Path, error: str, **fields: Any) -> None:
    """Record a run refused before it started (a bad value or combination) as ``failed``. It
    replaces the summary of an earlier refusal in the folder, so the folder names this attempt's
    mistake, but never a summary of a run (``holds_a_run``)."""
    if holds_a_run(run_dir):
        return
    now = now_iso()
    write_json_atomic(Path(run_dir) / SUMMARY, {"schema_version": SCHEMA_VERSION,
                                                 "run_dir": relative_run_dir(run_dir), "started_at": now,
                                                 **fields, "status": "failed", "error": error,
                                                 "finished_at": now})


def replace_error(run_dir: str | Path, error: str, **fields: Any) -> None:
    """Set a failed run's error to ``error`` (the root cause found after the fact, such as the
    rank that was killed), keeping what the run itself had recorded as ``error_seen_by_rank0``."""
    summary = read_summary(run_dir) or {"schema_version": SCHEMA_VERSION, "run_dir": relative_run_dir(run_dir),
                                        "started_at": now_iso()}
    if summary.get("status") == "completed":
        return
    if summary.get("error") and summary["error"] != error:
        summary.setdefault("error_seen_by_rank0", summary["error"])
    summary.update(fields)
    summary.update(status="failed", error=error)
    summary.setdefault("finished_at", now_iso())
    write_json_atomic(Path(run_dir) / SUMMARY, summary)


def write_test_predictions(run_dir: str | Path, predicted, label, num_classes: int) -> Path:
    """``TEST_PREDICTIONS`` in ``run_dir`` (atomically: a reader never sees half a file) from two
    integer sequences of the test set's length."""
    import numpy as np

    dtype = np.uint8 if num_classes <= 256 else np.int32
    predicted, label = np.asarray(predicted).astype(dtype), np.asarray(label).astype(dtype)
    if predicted.shape != label.shape or predicted.ndim != 1:
        raise ValueError(f"predictions {predicted.shape} and labels {label.shape}: one of each per test image")
    path = Path(run_dir) / TEST_PREDICTIONS
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, predicted=predicted, label=label)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_test_predictions(run_dir: str | Path):
    """``(predicted, label)`` of a run's ``TEST_PREDICTIONS`` (numpy arrays), or None where the
    run wrote none (runs before the file existed, runs that did not complete)."""
    import numpy as np

    path = Path(run_dir) / TEST_PREDICTIONS
    if not path.is_file():
        return None
    with np.load(path) as f:
        return f["predicted"], f["label"]


def read_heartbeat(run_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / HEARTBEAT).read_text())
    except (OSError, ValueError):
        return None


def _beat_age(beat: dict | None, now: float | None = None) -> float | None:
    """Seconds since a heartbeat (``read_heartbeat``'s) was written; None where there is none."""
    if not beat or not isinstance(beat.get("unix"), (int, float)):
        return None
    return (time.time() if now is None else now) - beat["unix"]


def unfinished_reason(run_dir: str | Path, summary: dict | None,
                      stale_after_s: float = HEARTBEAT_STALE_S, now: float | None = None) -> str | None:
    """``no heartbeat since <time> (step N)`` for a run that says ``running`` but has not beaten
    for ``stale_after_s`` seconds (or never did and started that long ago); None otherwise."""
    if not summary or summary.get("status") != "running":
        return None
    now = time.time() if now is None else now
    beat = read_heartbeat(run_dir)
    age = _beat_age(beat, now)
    if age is not None:
        if age < stale_after_s:
            return None
        step = f" (step {beat['step']})" if beat.get("step") is not None else ""
        return f"no heartbeat since {beat.get('time')}{step}"
    started = summary.get("started_at")
    try:
        started_unix = datetime.fromisoformat(started).timestamp()
    except (TypeError, ValueError):
        return "no heartbeat"
    return None if now - started_unix < stale_after_s else f"no heartbeat since {started} (start)"


def claim_run_folder(run_dir: str | Path) -> Callable[[], None]:
    """Hold ``run_dir`` for this process while it trains there; returns the call that lets it go.

    Two processes training in one folder (a sweep started twice, a command rerun in another
    terminal while the first still runs) would interleave their metrics.jsonl lines, checkpoints
    and summaries, and the folder would read as one run. The hold is an exclusive ``flock`` on the
    folder itself (no file is added): the kernel lets it go when the process ends, however it
    ends, so a run killed with SIGKILL never blocks its own resume. A second claim raises
    ``RunFolderInUse`` before anything is written. Where the file system has no ``flock`` (some
    network file systems), a heartbeat younger than HEARTBEAT_STALE_S from another live process
    refuses instead."""
    import fcntl

    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunFolderInUse(_in_use_line(run_dir)) from None
    except OSError:  # no flock here: the heartbeat is the only sign of a live run
        os.close(fd)
        if _beats_elsewhere(run_dir):
            raise RunFolderInUse(_in_use_line(run_dir)) from None
        return lambda: None
    held = [fd]

    def release() -> None:  # closing the descriptor lets the lock go; once is enough
        if held:
            os.close(held.pop())
    return release


def _beats_elsewhere(run_dir: str | Path) -> bool:
    beat = read_heartbeat(run_dir) or {}
    age = _beat_age(beat)
    if (read_summary(run_dir) or {}).get("status") != "running" or age is None or age >= HEARTBEAT_STALE_S:
        return False
    if beat.get("host") != os.uname().nodename:
        return True
    pid = beat.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _in_use_line(run_dir: str | Path) -> str:
    beat = read_heartbeat(run_dir) or {}
    age = _beat_age(beat)
    fresh = age is not None and age < HEARTBEAT_STALE_S
    who = (f"pid {beat.get('pid')} on {beat.get('host')}, step {beat.get('step')} at {beat.get('time')}"
           if fresh else "starting: no heartbeat yet")
    return (f"run folder {relative_run_dir(run_dir)}: in use by a run training there now ({who}); "
            "allowed: a folder no live run holds. Wait for it to end (a rerun then skips it), or stop "
            "it and rerun to resume from its checkpoint, or choose another folder (hydra.run.dir=..., "
            "hydra.sweep.dir=...)")


class Heartbeat:
    """Rank 0's sign of life: ``heartbeat.json`` = {time, unix, step, last_step_at, pid, host},
    rewritten atomically by a daemon thread while training runs (see HEARTBEAT_MIN_S /
    HEARTBEAT_EVERY_S). ``step`` is read through ``step_fn`` (once a second), ``last_step_at`` is
    when it was last seen to change. Once a second it also reads the node's 1-minute load average
    (``load``: what else ran beside the run while it was timed)."""

    def __init__(self, run_dir: str | Path, step_fn: Callable[[], int]):
        self.path = Path(run_dir) / HEARTBEAT
        self._step_fn = step_fn
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_step: int | None = None
        self._last_step_at: str | None = None
        self._written_step: int | None = None
        self._written_at = 0.0
        self._load_sum, self._load_max, self._load_readings = 0.0, 0.0, 0  # (a run may last days)

    def _observe(self) -> None:
        load = os.getloadavg()[0]
        self._load_sum, self._load_readings = self._load_sum + load, self._load_readings + 1
        self._load_max = max(self._load_max, load)
        step = self._step_fn()
        if step != self._last_step:
            self._last_step, self._last_step_at = step, now_iso()

    def beat(self) -> None:
        self._observe()
        step = self._last_step
        self._written_step, self._written_at = step, time.monotonic()
        try:
            write_json_atomic(self.path, {
                "time": now_iso(), "unix": time.time(), "step": step,
                "last_step_at": self._last_step_at, "pid": os.getpid(), "host": os.uname().nodename,
            })
        except OSError:  # a full disk must not kill the run from a side thread
            pass

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._observe()
            since = time.monotonic() - self._written_at
            if since >= HEARTBEAT_EVERY_S or (since >= HEARTBEAT_MIN_S and self._last_step != self._written_step):
                self.beat()

    def start(self) -> Heartbeat:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="sparsetrain-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.beat()

    def load(self, local_ranks: int) -> dict:
        """summary.json's ``load``: the node's 1-minute load average over the run (mean and
        largest of the once-a-second readings) beside its CPUs and this run's ranks on the node
        (each keeps about one CPU busy: a mean well above ``local_ranks`` means other work ran
        beside it, and its timings are not those of a quiet machine)."""
        return {"mean_1min": self._load_sum / max(self._load_readings, 1), "max_1min": self._load_max,
                "readings": self._load_readings, "cpus": os.cpu_count(), "local_ranks": local_ranks}


class RunWriter:
    """Writes one run's files. Only rank 0 holds one; other ranks get ``NullWriter``."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.summary: dict[str, Any] = {}
        self._metrics = None

    def start(self, **fields: Any) -> None:
        self.summary = {"schema_version": SCHEMA_VERSION, "status": "running", "error": None,
                        "started_at": now_iso(), **fields}
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


# Schemes that are torch's own DDP communication hooks (PowerSGD, fp16 and bf16 compression): they
# run only through DDP (dist.ddp=true) and have no scope or aggregation of sparsetrain's
# (conf/schemes.yaml: torch_hook).
TORCH_HOOK_SCHEMES = scheme_catalog.with_property("torch_hook")
# Schemes that send every entry, quantized (sparsetrain.compress.quantize): ``ratio`` does not
# apply to them (the analysis records 1.0, as for fp16 and bf16; conf/schemes.yaml: every_entry).
QUANTIZER_SCHEMES = tuple(s for s in scheme_catalog.with_property("every_entry") if s not in TORCH_HOOK_SCHEMES)


def recorded_scheme(node: Any) -> Any:
    """The scheme a recorded config (``scheme`` node, or its bare name) ran. Until sparsetrain had
    a PowerSGD of its own (issue 24), ``scheme=powersgd`` was torch's DDP hook, recorded with no
    compressor (``compressor: null``); it is ``torch_powersgd`` now (conf/schemes.yaml:
    ``formerly``). sparsetrain's PowerSGD records its compressor node."""
    name = node.get("name") if isinstance(node, dict) else node
    return scheme_catalog.formerly(name, has_compressor=bool(isinstance(node, dict) and node.get("compressor")))

# A run "did not train" when its final training loss is no better than a uniform guess over the
# classes (ln C, 2.30 for 10 classes): such a run diverged or never left the start, and its
# accuracy says nothing about the scheme. Tables list it apart and never rank it.


def untrained_why(loss: float | None, accuracy: float | None, num_classes: int = 10,
                  split: str = "test") -> str | None:
    """Why final numbers count as not trained (one line), or None: the final train loss is not
    below a uniform guess (ln classes), or the final accuracy on ``split`` (validation where the
    run held one out, else test) is below 20 %, whatever the loss (an accuracy not known does
    not count against the run)."""
    bound = math.log(num_classes)
    if loss is None or not math.isfinite(float(loss)):
        return f"final train loss {loss} is not finite"
    if float(loss) >= bound:
        return f"final train loss {float(loss):.3g} >= ln({num_classes}) = {bound:.2f}, a uniform guess"
    if accuracy is not None and float(accuracy) < MIN_TRAINED_ACCURACY:
        return f"final {split} accuracy {100 * float(accuracy):.1f}% < {100 * MIN_TRAINED_ACCURACY:g}%"
    return None


def judged_numbers(summary: dict) -> tuple[float | None, float | None, str]:
    """What "did not train" reads of a summary: the train loss at the end of training (the mean
    over the run's last steps, ``train_loss_final``; runs written before it: the last epoch's
    mean) and the validation accuracy (runs without a validation split: the test accuracy),
    with the split's name."""
    loss = summary.get("train_loss_final")
    if loss is None:
        loss = summary.get("train_loss")
    if summary.get("val_accuracy") is not None:
        return loss, summary["val_accuracy"], "validation"
    return loss, summary.get("test_accuracy"), "test"


def untrained_reason(summary: dict) -> str | None:
    """``untrained_why`` of a completed run's summary (``judged_numbers``); None for a run that
    did not complete."""
    if summary.get("status") != "completed":
        return None
    loss, accuracy, split = judged_numbers(summary)
    return untrained_why(loss, accuracy, summary.get("num_classes") or 10, split)


def peak_loss_of(summary: dict) -> float | None:
    """The largest batch loss from step ``STABILITY_FROM_STEP`` on that the run recorded (runs
    written before the record existed: None; the analysis then reads its logged steps)."""
    peak = (summary.get("train_loss_peak") or {}).get(f"after_step_{STABILITY_FROM_STEP}") or {}
    return peak.get("train_loss")
