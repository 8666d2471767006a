"""Before/after of the quantizers' CPU kernels: two checkouts' code, run in alternation.

    .venv/bin/python scripts/ab_quantizers.py --base /path/to/other/checkout --runs 4

Times ``encode`` and ``decode_add`` (one message) of signSGD, QSGD at s = 1 and QSGD at s = 127
(PCG64, which every checkout has; QSGD s = 1 with the counter generator too where it exists) on the ResNet-18 layout's compressed tensors (11.2M entries, one thread), the decode of W = 2,
4, 8 and 16 messages into one buffer (``decompress_many``, as after an AllGather of W ranks;
signSGD and QSGD s = 1), and numpy's PCG64 draw alone (what QSGD's random rounding costs before any of its own work), each in "copies":
the call's time over one gradient ``copy_`` timed just before it, median of --repeats. Each run
is a fresh process with ``PYTHONPATH`` set to one checkout, base and new alternated --runs times,
so that a load change slower than a run (~15 s) hits both sides. Prints the median and range
over runs per side. Run it on a quiet machine: these are timings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from ab_compress import alternate, summary, write_json  # scripts/: the same alternation

HERE = Path(__file__).resolve().parents[1]

# one run, in the checkout on PYTHONPATH: prints a JSON dict of copies per operation
_RUN = r"""
import json, statistics, sys, time
import numpy as np, torch
torch.set_num_threads(1)
from sparsetrain.benchmarks.compress import resnet18_shapes
from sparsetrain.compress import QSGD, Layout, SignSGD
repeats = int(sys.argv[1])
layout = Layout.from_sizes([int(np.prod(s)) for s in resnet18_shapes() if len(s) > 1])
g = torch.randn(layout.total, generator=torch.Generator().manual_seed(0))
out, scratch = torch.empty_like(g), torch.empty_like(g)
def copies(fn):
    fn()
    ratios = []
    for _ in range(repeats):
        t0 = time.perf_counter(); scratch.copy_(g); t1 = time.perf_counter(); fn(); t2 = time.perf_counter()
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(ratios)
def qsgd(levels, generator="pcg64"):  # PCG64 on both sides: the generator every checkout has
    try:
        return QSGD(1.0, layout, levels=levels, generator=generator)
    except TypeError:  # a checkout from before generator= (PCG64 only)
        return QSGD(1.0, layout, levels=levels)
res = {}
for name, comp in (("signSGD", SignSGD(1.0, layout)), ("QSGD s=1", qsgd(1)), ("QSGD s=127", qsgd(127))):
    values = torch.empty(comp.num_values)
    wire = torch.empty(comp.num_positions, dtype=torch.uint8)
    seed = [0]
    def encode():
        seed[0] += 1
        comp.encode(g, seed[0], values, wire)
    res[f"{name} encode"] = copies(encode)
    res[f"{name} decode_add"] = copies(lambda: comp.decode_add(values, wire, out))
    if name == "QSGD s=127":
        continue
    # every rank's message after an AllGather: W messages (from this process) into one buffer
    msgs = []
    for w in range(16):
        encode()
        msgs.append((values.clone(), wire.clone(), None))
    for W in (2, 4, 8, 16):
        if hasattr(comp, "decompress_many"):  # (code from before it: the loop it replaces)
            run = lambda W=W: comp.decompress_many(msgs[:W], out)
        else:
            run = lambda W=W: [comp.decompress_add(v, p, out) for v, p, _ in msgs[:W]]
        res[f"{name} decode x{W}"] = copies(run)
comp = qsgd(1, "counter")  # the counter-based generator (02a0591 on; the default from e752cf0)
if getattr(comp, "generator", "pcg64") == "counter":
    values, wire = torch.empty(comp.num_values), torch.empty(comp.num_positions, dtype=torch.uint8)
    res["QSGD s=1 encode, counter"] = copies(lambda: comp.encode(g, 1, values, wire))
u = np.empty(layout.total, dtype=np.float32)
res["PCG64 draw alone"] = copies(lambda: np.random.default_rng(seed[0]).random(layout.total, dtype=np.float32, out=u))
print(json.dumps(res))
"""


def one_run(checkout: Path, repeats: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    proc = subprocess.run([sys.executable, "-c", _RUN, str(repeats)], env=env, cwd=checkout, check=True,
                          capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, type=Path, help="the checkout to compare against")
    ap.add_argument("--new", type=Path, default=HERE, help="default: this checkout")
    ap.add_argument("--runs", type=int, default=4, help="runs per side, alternated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None, help="write every run's numbers here")
    args = ap.parse_args(argv)
    runs = alternate(args, lambda checkout, _: one_run(checkout, args.repeats))
    print(f"base: {args.base}\nnew:  {args.new}\n{args.runs} alternated runs per side; median (range) over "
          "runs, in copies of the gradient (11.2M float32 entries, 1 thread)")
    print(f"{'':<26}{'base':>22}{'new':>22}")
    for key in runs["new"][0]:  # a row one side lacks (a feature the base has not): "-"
        print(f"{key:<26}" + "".join(f"{summary([r[key] for r in runs[side]]) if key in runs[side][0] else '-':>22}"
                                     for side in ("base", "new")))
    write_json(args, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
