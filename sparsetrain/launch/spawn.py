"""Start ``world_size`` local ranks with PyTorch's elastic launcher (the API behind torchrun),
which also watches them: when one dies the others are stopped and the launch fails.
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Callable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn: Callable, args: tuple, world_size: int, *, port: int | None, log_dir: str,
                monitor_interval: float = 0.5):
    """Run ``fn(*args)`` in ``world_size`` local processes with torch's elastic launcher.

    Returns ``{rank: return value}``; raises ``ChildFailedError`` when any rank fails, after
    the agent has stopped the others (no process is left behind).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"sparsetrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port or free_port()}",
        rdzv_configs={"timeout": 60},
        max_restarts=0,
        monitor_interval=monitor_interval,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    # The agent logs every child's traceback at ERROR; the rank logs and the run's summary
    # already hold the failure, so keep the console to our one-line report.
    # torch gives each of its modules' loggers a level of its own, so set theirs too (the
    # agent's "Received 15 death signal" among them: the command line says what happened).
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    return elastic_launch(config, entrypoint=_rank_main)(fn, *args)


# What a rank sees when a peer is gone (gloo, NCCL): a symptom, not a cause.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
             "Connection refused", "remote process exited", "NCCL communicator was aborted")
PEER_LOST_GRACE_S = 5.0


def peer_lost(exc: BaseException) -> bool:
    text = f"{exc}"
    return any(p in text for p in PEER_LOST)


def _rank_main(fn: Callable, *args):
    """A local rank. One that fails only because a peer vanished waits a moment before exiting,
    so the agent (polling every ``monitor_interval``) sees the peer's death first and reports
    *that* rank ("rank 1 died (SIGKILL)") rather than this one's "Connection reset by peer"; the
    agent then stops this rank.

    A rank that got a stop signal but finished its run anyway (the signal came after the run's
    last check) exits with 128 + the signal once its files are written: the agent that passed
    the signal on no longer collects return values, and a rank waiting to hand its own over would
    hang until the agent kills it 30 s later. (An exit, not the signal's default action, so that
    the process cleans up its semaphores instead of leaking them.)"""
    try:
        result = fn(*args)
    except Exception as exc:
        if peer_lost(exc):
            import time

            time.sleep(PEER_LOST_GRACE_S)
        raise
    from sparsetrain.train.signals import received

    sig = received()
    if sig is not None:
        raise SystemExit(128 + int(sig))
    return result
