"""The paper's core comparison in miniature: `make run`.

Dense SGD, top-k, random-k and block-random-k at 1% (layer-wise, AllGather, error feedback) on
Fashion-MNIST with ResNet-20 and 2 ranks, then one table: test accuracy, ms per phase, bytes
sent per step, and the final train loss with a verdict: a run whose loss is not below ln 10 (a
uniform guess) "did not train". Extra arguments are passed to every run as Hydra overrides, e.g.
`python -m sparsetrain.benchmarks.compare train.epochs=3` or `... data=synthetic train.max_steps=20`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from sparsetrain.benchmarks.harness import REPO as ROOT
from sparsetrain.benchmarks.tables import grid
from sparsetrain.results import DID_NOT_TRAIN, untrained_reason  # no torch

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
    rows = []
    for path in sorted(sweep.glob("*/summary.json"), key=lambda p: int(p.parent.name)):
        s = json.loads(path.read_text())
        t = s.get("time_ms") or {}
        name = s["config"]["scheme"]["name"] if "config" in s else path.parent.name
        loss = s.get("train_loss")
        rows.append([
            "dense" if name == "none" else name,
            DID_NOT_TRAIN if untrained_reason(s) else s["status"],
            f"{loss:.3f}" if loss is not None else "-",
            f"{100 * s['test_accuracy']:.2f}" if s.get("test_accuracy") is not None else "-",
            *(f"{t.get(k, 0):.1f}" for k in ("forward", "backward", "compress", "exchange",
                                               "decompress", "step")),
            f"{s.get('bytes_sent_per_step', 0):,}",
            f"{s.get('bytes_sent_per_step', 0) / max(1, s.get('dense_bytes_per_step', 1)):.4f}",
        ])
    head = ["scheme", "status", "train loss", "test acc %", "fwd ms", "bwd ms", "compress ms", "exchange ms",
            "decompress ms", "step ms", "bytes/step", "vs dense"]
    return grid(head, rows)


def main(argv: list[str]) -> int:
    sweep = ROOT / "outputs" / "compare" / time.strftime("%Y-%m-%d_%H-%M-%S")
    cmd = [sys.executable, "-m", "sparsetrain.run", "-m", f"scheme={SCHEMES}", *DEFAULTS, *argv,
           f"hydra.sweep.dir={sweep}"]
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.time()
    code = subprocess.call(cmd, cwd=ROOT)
    print(f"\n{SCHEMES.count(',') + 1} runs in {time.time() - t0:.0f} s; run folders under {sweep}\n")
    print(table(sweep))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
