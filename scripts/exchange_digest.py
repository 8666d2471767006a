"""Digests of what the trainer's exchange hands the optimizer, for every built-in scheme: run it
on two checkouts and compare the lines, to show that a rebuild of the exchange leaves its
behaviour bit-identical (2 gloo ranks, a small CNN's tensor shapes, 6 steps of seeded random
gradients after one dense warm-up step, error feedback on and off).

    PYTHONPATH=<checkout> python scripts/exchange_digest.py > digests.txt   # in each checkout
    diff old.txt new.txt

Each line: scheme and error feedback, the SHA-256 prefix of every step's averaged update, and the
last step's compression error, memory norm, bytes sent and collective (the statistics are logged
values: their last digits may move where their formula does; the digest may not).
"""

import hashlib
import os
import sys
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from sparsetrain.comm import build_exchange
    from sparsetrain.compress import QSGD, BlockRandomK, PowerSGD, RandomK, SignSGD, TopK
    from sparsetrain.timing import NULL_TIMER

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 8, 3),
                              torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10))
    cases = [("powersgd", "allreduce", partial(PowerSGD, rank=2)), ("powersgd", "allreduce", PowerSGD),
             ("topk", "allgather", TopK), ("randk", "allreduce", RandomK), ("blockk", "allgather", BlockRandomK),
             ("signsgd", "allgather", SignSGD), ("qsgd", "allgather", QSGD)]
    lines = []
    for scheme, aggregation, compressor in cases:
        for ef in (True, False):
            flat, _, red = build_exchange(list(net.parameters()), scheme, "layerwise", aggregation, 0.05,
                                          world_size=world, rank=rank, seed=3, compressor=compressor,
                                          error_feedback=ef, warmup_steps=1)
            digest = hashlib.sha256()
            for step in range(6):
                flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(100 * step + rank)))
                stats = red.reduce(flat, step, NULL_TIMER, want_stats=True)
                digest.update(flat.numpy().tobytes())
            name = ",".join(f"{k}={v}" for k, v in (getattr(compressor, "keywords", None) or {}).items()) or "-"
            lines.append(f"{scheme} {name} ef={ef} {digest.hexdigest()[:16]} "
                         f"{stats.compression_error} {stats.memory_norm} {stats.bytes_sent} {stats.collective}")
    if rank == 0:
        queue.put(lines)
    dist.destroy_process_group()


def main() -> int:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_run, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    lines = queue.get()
    for p in procs:
        p.join()
    print("\n".join(lines))
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
