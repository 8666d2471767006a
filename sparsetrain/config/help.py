"""What ``python -m sparsetrain.run --help`` prints (``help_text``): a line for every group
(``GROUP_HELP``) and every key (``HELP``)."""

from __future__ import annotations

from pathlib import Path

from sparsetrain.config.overrides import FREE_FORM, group_options
from sparsetrain.config.schema import CONF_DIR, GROUPS, schema_keys

# One line per group and key: what `--help` prints. tests/test_config.py checks that every key of
# the schema has one, so a new key cannot be left undescribed.
GROUP_HELP = {
    "scheme": "how gradients are compressed: none (dense SGD), topk, randk, blockk, powersgd, signsgd, qsgd; torch_powersgd, fp16, bf16 need dist.ddp=true",
    "scope": "layerwise (k per tensor) or global (one k over the flattened model)",
    "aggregation": "allgather (own positions, gathered) or allreduce (shared positions, summed; not topk)",
    "model": "resnet20 (0.27M parameters) or resnet18 (CIFAR variant, 11.2M, the paper's)",
    "data": "fashion_mnist (offline), cifar10 (downloads into data.root), synthetic (generated)",
    "experiment": "a preset with its own sweep grid (conf/experiment/), run with -m; writes under multirun/<preset>/",
    "point": "a named point of a study whose points differ in several keys (conf/point/), e.g. frontier_signsgd",
    "debug": "tiny: small, fast settings for smoke runs and tests (synthetic data, 512 images, no W&B)",
}
HELP = {
    "world_size": "data-parallel ranks, >= 1",
    "ratio": "fraction of gradient entries sent per step, 0 < ratio <= 1 (scheme=none ignores it)",
    "seed": "seeds the weights, the data order and the shared random positions",
    "scheme.name": "the scheme (set it with scheme=...)",
    "scheme.compressor": "how the compressor is built (set by scheme=...)",
    "scheme.memory": "what a worker keeps of what it did not send: a Memory class node (null: error feedback)",
    "scheme.sync": "synchronise every `period` steps (local SGD, DiLoCo): a PeriodicSync node (null: every step)",
    "scheme.error_feedback": "keep what was not sent and add it to the next gradient (false: the ablation)",
    "scheme.block_size": "scheme=blockk only, with scope=global: entries per contiguous block",
    "scheme.uncompressed": "tensors sent whole: 1d (biases, batch-norm), none, or N (tensors under N entries)",
    "scheme.warmup_steps": "exchange densely for the first N steps, then compress (memory starts empty)",
    "scheme.rank": "scheme=powersgd, torch_powersgd only: the matrix rank (null: the bytes closest to the sparse schemes' at ratio)",
    "scheme.levels": "scheme=qsgd only: quantization levels s per bucket, an integer in [1, 65535] (1 + ceil(log2(s+1)) bits an entry)",
    "scheme.bucket_size": "scheme=qsgd only: entries per bucket, each with its own float32 norm, an integer >= 1 (null: one norm per tensor, or per buffer with scope=global)",
    "scheme.generator": "scheme=qsgd only: the random rounding's uniforms, counter (SplitMix64: the same numbers on every device) | pcg64 (numpy's PCG64; torch's generator on CUDA; QSGD's runs before this key)",
    "scope.name": "the scope (set it with scope=...)",
    "aggregation.name": "the aggregation (set it with aggregation=...)",
    "model._target_": "the function that builds the model (set by model=...)",
    "model._partial_": "built once the data's shape is known (set by model=...)",
    "model.name": "the model (set it with model=...)",
    "data.name": "the data set (set it with data=...)",
    "data.root": "where data sets live (default: $SPARSETRAIN_DATA, else data/)",
    "data.download": "download a data set that is not there",
    "data.train_size": "train on the first N training examples (null: all); for short runs",
    "data.test_size": "evaluate on the first N test examples (null: all); evaluation dominates short runs",
    "data.val_size": "hold out N training images as the validation split (the same draw for every run); choices read it, the test set is only reported (0: none)",
    "data.augment": "random crops and flips of the training images",
    "train.epochs": "epochs to train; the lr warm-up and milestones are fractions of them",
    "train.max_steps": "stop after N steps (null: no cap); raising it resumes a capped run further",
    "train.batch_size": "examples per rank per step",
    "train.eval_every": "evaluate on the test set every N epochs, and at the end",
    "train.curve_points": "accuracy-curve points per epoch (needs data.val_size): the validation subset scored at N evenly spaced steps, for time to accuracy (1: none)",
    "train.stop_at_accuracy": "stop at the first curve point whose validation accuracy reaches this, in (0, 1] (needs train.curve_points > 1); summary.json's target says when (null: the whole budget)",
    "train.curve_size": "validation images each curve point scores, the first N of the split (null: all)",
    "train.log_every": "log a step record every N steps; stop signals and divergence are checked then",
    "train.device": "auto, cpu or cuda (one GPU per rank)",
    "train.threads": "torch threads per rank (null: cores / local ranks)",
    "train.fast_path": "fused Triton kernels (top-k, random-k, block-k, signSGD, QSGD at 2/4/8 bits) and PowerSGD batched by shape, on CUDA (untimed: docs/performance.md)",
    "train.timing_warmup": "first steps left out of the per-phase time means",
    "train.checkpoint": "save checkpoint.pt every epoch and on a stop signal, and resume from it",
    "train.save_model": "write the final weights to model.pt",
    "train.progress": "progress bar on rank 0 when attached to a terminal",
    "train.bn_recalibrate": "recompute batch-norm statistics from N training batches before each evaluation (0: off)",
    "train.allow_code_change": "resume a checkpoint written by other code (another commit, other changes)",
    "optim.lr": "learning rate per rank (times world_size when optim.scale_lr)",
    "optim.scale_lr": "scale the lr linearly with world_size",
    "optim.momentum": "SGD momentum",
    "optim.nesterov": "Nesterov momentum",
    "optim.weight_decay": "weight decay (not on batch-norm parameters and biases)",
    "optim.warmup_epochs": "linear lr warm-up over this many epochs",
    "optim.milestones": "fractions of train.epochs, increasing, each in (0, 1): the lr is multiplied by optim.gamma there",
    "optim.gamma": "lr factor at each milestone",
    "wandb.mode": "offline (files in the run folder), online (needs a key), disabled",
    "wandb.project": "W&B project",
    "wandb.entity": "W&B entity (null: your default)",
    "wandb.group": "W&B group (null: the sweep folder, shared by a sweep's jobs)",
    "wandb.tags": "W&B tags",
    "dist.backend": "auto (nccl on cuda, gloo on cpu), gloo or nccl",
    "dist.timeout_s": "collective timeout in seconds: a dead rank cannot hang the job longer",
    "dist.ranks_per_node": "SLURM: ranks per node (null: all on one node)",
    "dist.master_port": "local ranks: rendezvous port (null: a free one)",
    "dist.overlap": "dense: start bucketed AllReduces during backward, as DDP does",
    "dist.overlap_bucket_mb": "dist.overlap: bucket size in MB (all buckets but the first)",
    "dist.overlap_first_bucket_mb": "dist.overlap: size in MB of the first bucket backward fills",
    "dist.ddp": "train through torch DDP, the exchange in a communication hook",
    "dist.bucket_cap_mb": "DDP's bucket size in MB",
}



def help_text(dirs: tuple[Path, ...] = ()) -> str:
    """What ``python -m sparsetrain.run --help`` prints: usage, the groups (with the options in the
    extra config folders ``dirs``), every key."""
    import textwrap

    from omegaconf import OmegaConf

    defaults = {}
    for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))["defaults"]:
        if isinstance(entry, dict):
            defaults.update(entry)
    lines = [
        "python -m sparsetrain.run [key=value ...]        one run, in outputs/DATE/TIME/",
        "python -m sparsetrain.run -m [key=a,b ...]       a sweep, one run per combination, in multirun/DATE/TIME/N/",
        "",
        "Groups (group=option; conf/<group>/<option>.yaml):",
    ]
    for group in GROUPS:
        default = defaults.get(group) or "null"
        options = textwrap.wrap(f"{' | '.join(group_options(group, dirs))} (default {default})", 86)
        lines += [f"  {group:<12} {GROUP_HELP[group]}", *(f"  {'':<12} {line}" for line in options)]
    lines += ["", "Keys (key=value):"]
    keys = schema_keys()
    for key in sorted(keys, key=lambda k: "." in k):  # the top-level keys first
        if key in FREE_FORM or key.endswith((".name", "._target_", "._partial_")):
            continue  # set by their group
        default = keys[key]
        shown = ("null" if default is None else str(default).lower() if isinstance(default, bool)
                 else "see left" if "${" in str(default) else default)
        lines.append(f"  {key:<24} {HELP[key]} (default {shown})")
    lines += [
        "",
        "Folders: hydra.run.dir=... (a run), hydra.sweep.dir=... (a sweep); rerunning into a folder",
        "resumes what was interrupted and skips what completed. More: docs/running.md, conf/config.yaml;",
        "Hydra's own options: --hydra-help; the composed config: --cfg job.",
    ]
    return "\n".join(lines)


