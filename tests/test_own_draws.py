"""A researcher's random compressor under DDP (issue 62, "nothing silently wrong"): written as
docs/own_compressor.md says (its class, taken from the page: each tensor's numbers from
``tensor_seed``), it trains through the DDP hook bit for bit as through the trainer's exchange;
one that keys its draws on its own segment numbers (a DDP bucket's are not the model's) is
refused before it trains, in one line. 2 gloo ranks, a small CNN in several DDP buckets."""

import re

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import ROOT
from test_ddp_hook import CAP_MB, _free_port, batch, net

from sparsetrain.comm import build_exchange
from sparsetrain.comm.ddp_hook import SparseHookState, sparse_hook
from sparsetrain.compress import Compressor, step_seed
from sparsetrain.timing import NULL_TIMER

SEED, RATIO, STEPS, LR = 7, 0.1, 4, 0.1


def _from_docs(name: str):
    """The class ``name`` as docs/own_compressor.md writes it (its python block, run as is)."""
    text = (ROOT / "docs" / "own_compressor.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if f"class {name}(" in b)
    namespace = {"torch": torch, "Compressor": Compressor}
    exec(block, namespace)
    return namespace[name]


# random-k, each tensor's k_j positions drawn from its own seed: ``tensor_seed`` (the docs' way)
PerTensorRandomK = _from_docs("PerTensorRandomK")


class OwnNumbersRandomK(PerTensorRandomK):
    """The same, each tensor's seed made from the step's seed and the segment's number j here: in
    a DDP bucket, j is not the tensor's number in the model."""

    def tensor_seed(self, seed, j, rank=None):
        return step_seed(seed, j, rank)


def _trainer(rank, world, compressor):
    model = net()
    flat, _, red = build_exchange(model.parameters(), "mine", "layerwise", "allgather", RATIO,
                                  world_size=world, rank=rank, seed=SEED, compressor=compressor)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        red.reduce(flat, step, NULL_TIMER)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp(rank, world, compressor):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(net(), bucket_cap_mb=CAP_MB)
    state = SparseHookState(model, "mine", "layerwise", "allgather", RATIO, seed=SEED, compressor=compressor)
    model.register_comm_hook(state, sparse_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.module.parameters()], len(state._buckets)


def _worker(rank, world, port, path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = {"trainer": _trainer(rank, world, PerTensorRandomK)}
        out["ddp"], out["buckets"] = _ddp(rank, world, PerTensorRandomK)
        try:
            _ddp(rank, world, OwnNumbersRandomK)
            out["refused"] = None
        except Exception as exc:  # noqa: BLE001  (what DDP hands back of the hook's error)
            out["refused"] = str(exc)
        torch.save(out, f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_per_tensor_random_compressor_trains_through_ddp_as_through_the_trainer(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert out["buckets"] >= 3  # several buckets: their segment numbers are not the model's
        start = [p.detach() for p in net().parameters()]
        assert max(float((a - b).abs().max()) for a, b in zip(out["trainer"], start)) > 0  # it trained
        for a, b in zip(out["trainer"], out["ddp"], strict=True):
            assert torch.equal(a, b)
        refused = out["refused"]
        assert refused is not None, "a compressor drawing by the bucket's segment numbers trained under DDP"
        line = next(line for line in refused.splitlines() if "OwnNumbersRandomK sends other numbers" in line)
        assert "self.tensor_seed(seed, j)" in line and "share_draws" in line, line
