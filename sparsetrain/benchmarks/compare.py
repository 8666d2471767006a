"""The paper's core comparison in miniature: `make run`.

Dense SGD, top-k, random-k and block-random-k at 1% (layer-wise, AllGather, error feedback) on
Fashion-MNIST with ResNet-20 and 2 ranks, then one table: test accuracy, ms per phase, bytes
sent per step, and the final train loss with a verdict: a run whose loss is not below ln 10 (a
uniform guess) "did not train". Extra arguments are passed to every run as Hydra overrides, e.g.
`python -m sparsetrain.benchmarks.compare train.epochs=3` or `... data=synthetic train.max_steps=20`.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from sparsetrain.benchmarks.harness import REPO as ROOT
from sparsetrain.launch.report import runs_table, sweep_jobs  # no torch
from sparsetrain.scheme_catalog import is_dense

SCHEMES = "none,topk,randk,blockk"
DEFAULTS = [
    "data=fashion_mnist",
    "model=resnet20",
    "world_size=2",
    "ratio=0.01",
    "train.epochs=1",
    "data.train_size=20000",
    "train.batch_size=64",
    "data.augment=false",
    "optim.lr=0.05",
    "optim.warmup_epochs=0.2",
    "train.progress=false",
    "wandb.mode=offline",
]


def table(sweep: Path) -> str:
    """The sweep's table, one row per scheme, with every phase: what `make run` prints."""
    rows = []
    for job in sweep_jobs(sweep):
        path = job / "summary.json"
        s = json.loads(path.read_text()) if path.exists() else None
        name = s["config"]["scheme"]["name"] if s and "config" in s else job.name
        rows.append((["dense" if is_dense(name) else name], s))
    return runs_table(rows, head=("scheme",),
                      phases=("forward", "backward", "compress", "exchange", "decompress", "step"))


def shown(cmd: list[str]) -> str:
    """The command as one can paste it from the repository root (where it runs): the interpreter
    and paths under the repository relative to it (``.venv/bin/python``), quoted for the shell."""
    def relative(arg: str) -> str:
        key, sep, value = arg.rpartition("=") if "=" in arg else ("", "", arg)
        path = Path(value)
        if path.is_absolute() and path.is_relative_to(ROOT):
            value = path.relative_to(ROOT).as_posix()
        return f"{key}{sep}{value}"
    return " ".join(shlex.quote(relative(arg)) for arg in cmd)


def main(argv: list[str]) -> int:
    sweep = ROOT / "outputs" / "compare" / time.strftime("%Y-%m-%d_%H-%M-%S")
    # The sweep's own short table is left out: the one below has every phase.
    cmd = [sys.executable, "-m", "sparsetrain.run", "-m", f"scheme={SCHEMES}", *DEFAULTS, *argv,
           f"hydra.sweep.dir={sweep}", "hydra.callbacks.sweep_report.table=false"]
    print("$", shown(cmd), flush=True)
    t0 = time.time()
    code = subprocess.call(cmd, cwd=ROOT)
    print(f"\n{SCHEMES.count(',') + 1} runs in {time.time() - t0:.0f} s; run folders under {sweep.relative_to(ROOT)}\n")
    print(table(sweep))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
