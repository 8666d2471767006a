"""Dense exchange must train exactly like torch's DistributedDataParallel (2 gloo ranks)."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import TINY
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from sparsetrain.config import CONF_DIR, register
from sparsetrain.launch.spawn import free_port
from sparsetrain.rank import RankInfo

STEPS = 3


def _worker(rank: int, world: int, port: int, cfg_dict: dict, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparsetrain.data import ShardedLoader
    from sparsetrain.models import build_model, param_groups_for_weight_decay
    from sparsetrain.train import Trainer, lr_at

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = OmegaConf.create(cfg_dict)
    trainer = Trainer(cfg, RankInfo(rank, world, rank, world, "spawn"), os.path.join(out_dir, "run"),
                      torch.device("cpu"))
    trainer.fit()
    ours = [p.detach().clone() for p in trainer.model.parameters()]

    data = trainer.data
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model.name, data.in_channels, data.num_classes)
    ddp = DDP(model)
    opt = torch.optim.SGD(param_groups_for_weight_decay(model, cfg.optim.weight_decay),
                          lr=cfg.optim.lr, momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov)
    loader = ShardedLoader(data.train_x, data.train_y, cfg.train.batch_size, rank=rank,
                           world_size=world, seed=cfg.seed, augment=cfg.data.augment,
                           padding=data.augment_padding, flip=data.flip)
    for step, (xb, yb) in enumerate(loader.batches(0)):
        if step == STEPS:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, len(loader), cfg, world)
        opt.zero_grad()
        F.cross_entropy(ddp(xb), yb).backward()
        opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(ours, model.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(ours, trainer_init(cfg, data)))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"diff": diff, "moved": moved}, f)
    dist.destroy_process_group()


def trainer_init(cfg, data):
    from sparsetrain.models import build_model

    torch.manual_seed(cfg.seed)
    return list(build_model(cfg.model.name, data.in_channels, data.num_classes).parameters())


@pytest.mark.slow  # dense SGD through DDP: the torch hooks' runs keep DDP in the fast tier
def test_dense_matches_ddp(tmp_path):
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*TINY, "scheme=none", "world_size=2",
                                                        f"train.max_steps={STEPS}",
                                                        "train.checkpoint=false"])
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    mp.spawn(_worker, args=(2, free_port(), cfg_dict, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["moved"] > 1e-4  # training really changed the weights
        assert result["diff"] < 1e-5, result
