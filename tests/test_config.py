"""Config composition, schema rejection and semantic checks (no ranks started)."""

import pytest
from conftest import ROOT, SCHEME_CLASSES, SCHEME_TARGETS, SCHEMES, compressor_for
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from sparsetrain.config import (
    CONF_DIR,
    HELP,
    SCHEME_SCHEMAS,
    ConfigError,
    check_overrides,
    compressor_class,
    register,
    scheme_compressor,
    scheme_options,
    validate,
)
from sparsetrain.train import lr_at

register()


def make(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_config_composes_and_validates():
    cfg = make()
    assert cfg.scheme.name == "none" and cfg.aggregation.name == "allgather"
    assert cfg.world_size == 2 and cfg.ratio == 0.01
    validate(cfg, env={})


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_composes(scheme):
    """Every scheme in conf/scheme/ composes and validates through DDP, which every scheme runs
    with (torch's hooks only with it)."""
    cfg = make(f"scheme={scheme}", "dist.ddp=true")
    assert cfg.scheme.name == scheme
    validate(cfg, env={})


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_schemes_class_comes_from_its_yaml(scheme):
    """One route from scheme=<name> to its class: the yaml's compressor node (the tests'
    ``compressor_for`` reads the same node)."""
    factory = scheme_compressor(make(f"scheme={scheme}").scheme)
    if SCHEME_TARGETS[scheme] is None:
        assert factory is None and compressor_for(scheme) is None
    else:
        assert factory.func is compressor_class(SCHEME_TARGETS[scheme]) is compressor_for(scheme).func
        assert factory.func.__name__ == SCHEME_CLASSES[scheme]


def test_each_scheme_has_only_its_own_keys():
    blockk = make("scheme=blockk", "scheme.block_size=64", "scope=global")
    assert blockk.scheme.block_size == 64 and "rank" not in blockk.scheme
    assert scheme_compressor(blockk.scheme).keywords == {"block_size": 64}  # the node passes it on
    assert make("scheme=powersgd", "scheme.rank=2").scheme.rank == 2
    assert make("scheme=torch_powersgd", "scheme.rank=2").scheme.rank == 2
    assert make("scheme=qsgd", "scheme.levels=3").scheme.levels == 3
    assert scheme_compressor(make("scheme=qsgd", "scheme.levels=3").scheme).keywords == {
        "levels": 3, "bucket_size": 512, "generator": "counter"}
    assert scheme_compressor(make("scheme=qsgd", "scheme.bucket_size=null", "scheme.generator=pcg64").scheme).keywords == {
        "levels": 127, "bucket_size": None, "generator": "pcg64"}
    for scheme in (s for s in SCHEMES if s not in SCHEME_SCHEMAS):  # the schemes without keys of their own
        node = make(f"scheme={scheme}").scheme
        assert not {"block_size", "rank", "levels", "bucket_size", "generator"} & set(node), scheme
    with pytest.raises(ConfigCompositionException):  # Hydra refuses it too, where the CLI does not check
        make("scheme=topk", "scheme.block_size=64")
    assert scheme_options() == {"scheme.block_size": ("blockk",), "scheme.rank": ("powersgd", "torch_powersgd"),
                                "scheme.levels": ("qsgd",), "scheme.bucket_size": ("qsgd",),
                                "scheme.generator": ("qsgd",)}
    assert set(SCHEME_SCHEMAS) == {"blockk", "powersgd", "torch_powersgd", "qsgd"}
    assert "scheme=blockk" in HELP["scheme.block_size"] and "scheme=powersgd" in HELP["scheme.rank"]


@pytest.mark.parametrize(
    "override", ["world_size=abc", "ratio=high", "train.epochz=3", "scheme.error_feedback=maybe"]
)
def test_schema_rejects_typos_and_types(override):
    with pytest.raises(ConfigCompositionException):
        make(override)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["world_size=0"], "world_size=0"),
        (["ratio=2"], "ratio=2.0"),
        (["ratio=0"], "ratio=0.0"),
        (["scheme=topk", "aggregation=allreduce"], "aggregation='allreduce'"),
        (["wandb.mode=loud"], "wandb.mode='loud'"),
        (["train.batch_size=0"], "train.batch_size=0"),
        (["dist.ddp=true", "world_size=1"], "dist.ddp=true is not allowed with world_size=1"),
        (["scheme=torch_powersgd"], "scheme=torch_powersgd is not allowed with dist.ddp=false"),
        (["scheme=fp16"], "scheme=fp16 is not allowed with dist.ddp=false"),
        (["scheme=bf16"], "scheme=bf16 is not allowed with dist.ddp=false"),
        (["scheme=signsgd", "aggregation=allreduce"], "aggregation='allreduce' is not available for scheme='signsgd'"),
        (["scheme=qsgd", "aggregation=allreduce"], "aggregation='allreduce' is not available for scheme='qsgd'"),
        (["scheme=qsgd", "scheme.levels=0"], "scheme.levels=0 is not allowed; it must be an integer in [1, 65535]"),
        (["scheme=qsgd", "scheme.levels=70000"], "scheme.levels=70000 is not allowed"),
        (["scheme=qsgd", "scheme.bucket_size=0"], "scheme.bucket_size=0 is not allowed; it must be an integer >= 1"),
        (["scheme=qsgd", "scheme.bucket_size=-1"], "scheme.bucket_size=-1 is not allowed; it must be an integer >= 1"),
        (["scheme=torch_powersgd", "dist.ddp=true", "scheme.rank=0"], "scheme.rank=0"),
        (["scheme=powersgd", "scheme.rank=0"], "scheme.rank=0"),
        (["scheme=powersgd", "scope=global"], "scope='global' is not allowed for scheme='powersgd'"),
        (["scheme=blockk", "scheme.block_size=0"], "scheme.block_size=0 is not allowed"),
        (["dist.ddp=true", "dist.bucket_cap_mb=0"], "dist.bucket_cap_mb=0.0"),
        (["optim.momentum=0"], "optim.momentum=0 is not allowed with optim.nesterov=true: Nesterov momentum "
                               "needs optim.momentum > 0; add optim.nesterov=false for plain SGD"),
        (["scheme=localsgd", "optim.momentum=0.0"], "optim.momentum=0 is not allowed with optim.nesterov=true"),
        (["optim.momentum=-0.5", "optim.nesterov=false"], "optim.momentum=-0.5 is not allowed; it must be >= 0"),
    ],
)
def test_semantic_errors_name_key_value_and_allowed(overrides, needle):
    with pytest.raises(ConfigError) as info:
        validate(make(*overrides), env={})
    msg = str(info.value)
    assert needle in msg and "\n" not in msg


def test_plain_sgd_is_momentum_0_without_nesterov():
    validate(make("optim.momentum=0", "optim.nesterov=false"), env={})


DGC = ("--config-dir", str(ROOT / "examples" / "dgc" / "conf"))


def test_a_memory_or_sync_option_is_checked_against_its_class(monkeypatch):
    """``scheme.memory.<option>`` and ``scheme.sync.<option>`` as ``scheme.compressor.<option>``:
    an argument of the class the scheme's node names, with or without ``+``, in one line before
    Hydra composes (which would say it in 7 lines, or add the key for a TypeError at start)."""
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "dgc"))
    refused = {
        ("scheme=topk", "scheme.memory.foo=1"):
            "scheme.memory.foo=1: scheme=topk has no memory (scheme.memory is null: error feedback, which takes "
            "no options; a memory of one's own is named in the scheme's yaml, docs/own_compressor.md)",
        ("scheme=topk", "+scheme.memory.foo=1"): "+scheme.memory.foo=1: scheme=topk has no memory",
        (*DGC, "scheme=dgc_randk", "scheme.memory.foo=1"):
            "scheme.memory.foo=1: dgc.MomentumCorrection takes no argument 'foo'; it takes momentum "
            "(scheme.memory.<option>=...)",
        (*DGC, "scheme=dgc_randk", "+scheme.memory.foo=1"): "+scheme.memory.foo=1: dgc.MomentumCorrection takes no argument",
        ("scheme=diloco", "scheme.sync.foo=1"):
            "scheme.sync.foo=1: sparsetrain.comm.periodic.PeriodicSync takes no argument 'foo'; it takes period, "
            "outer_lr, outer_momentum, nesterov (scheme.sync.<option>=...)",
        ("scheme=topk", "scheme.sync.period=4"):
            "scheme.sync.period=4: scheme=topk has no sync (scheme.sync is null: every step's exchange; "
            "periodic synchronisation is scheme=localsgd or scheme=diloco)",
    }
    for args, needle in refused.items():
        with pytest.raises(ConfigError) as info:
            check_overrides(list(args))
        assert str(info.value).startswith(needle) and "\n" not in str(info.value), (args, str(info.value))
    # a yaml's node is checked too (what check_overrides does not see: the yaml itself)
    with pytest.raises(ConfigError, match=r"^scheme.sync.foo=1: .*PeriodicSync takes no argument 'foo'; it takes period"):
        validate(make("scheme=diloco", "++scheme.sync.foo=1"), env={})
    # an option the class takes is added to the node whether the yaml sets it or not, with or without +
    from sparsetrain.launch.cli import _class_option

    assert [_class_option(a) for a in ("scheme.sync.period=4", "+scheme.memory.momentum=0.5",
                                       "scheme.memory._target_=x.Y", "~scheme.memory", "optim.lr=1")] == [
        "++scheme.sync.period=4", "++scheme.memory.momentum=0.5", "scheme.memory._target_=x.Y", "~scheme.memory",
        "optim.lr=1"]
    for args in ([*DGC, "scheme=dgc_randk", "+scheme.memory.momentum=0.5"], ["scheme=diloco", "scheme.sync.period=4"]):
        check_overrides(args)
    for overrides in (["scheme=diloco", "scheme.sync.period=4", "+scheme.sync.nesterov=false"],):
        cfg = make(*(_class_option(a) for a in overrides))
        validate(cfg, env={})
        assert cfg.scheme.sync.period == 4 and cfg.scheme.sync.nesterov is False


def test_unknown_group_option_is_one_line():
    with pytest.raises(ConfigError, match=rf"scheme='nope' is not allowed; choose one of: {', '.join(sorted(SCHEMES))}$"):
        check_overrides(["scheme=topk,nope"])
    check_overrides(["scheme=topk,randk", "ratio=0.1", "hydra.run.dir=x"])


def test_world_size_must_match_launcher_environment():
    from sparsetrain.launch.env import check_launch_environment

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match="world_size=4 contradicts the launcher: torchrun"):
        check_launch_environment(make("world_size=4").world_size, env)
    check_launch_environment(make("world_size=2").world_size, env)
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_JOB_ID": "7"}
    with pytest.raises(ConfigError, match="SLURM_NTASKS=3"):
        check_launch_environment(make("world_size=2").world_size, slurm)


def test_ranks_on_netclusters_namespaces_share_one_machine():
    """torchrun in each of netcluster's namespaces says LOCAL_WORLD_SIZE=1, but all its ranks share
    this machine's cores: the rank's local world (its default threads: cores / local ranks) is
    netcluster's node count, so 4 ranks on 2 cores take 1 thread each, not 2 (5-6x slower)."""
    from sparsetrain.launch.env import rank_info
    from sparsetrain.launch.netcluster import Cluster, node_env

    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1", "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1"}
    assert rank_info(torchrun).local_world_size == 1
    node = node_env(Cluster("tst", 4, "10.77.0", "1gbit", "0ms", None, "100ms", 1500), 1, torchrun)
    assert node["ST_NETNS_HOST_RANKS"] == "4"
    info = rank_info(node)
    assert info.local_world_size == 4 and info.local_rank == 0 and info.link["rate_bits"] == 1e9


def test_slurm_task_resolvers():
    cfg = make("world_size=8", "dist.ranks_per_node=4")
    assert OmegaConf.select(cfg, "dist.ranks_per_node") == 4
    from sparsetrain.config import _nodes, _tasks_per_node

    assert (_nodes(8, 4), _tasks_per_node(8, 4)) == (2, 4)
    assert (_nodes(3, None), _tasks_per_node(3, None)) == (1, 3)


def test_lr_schedule_warmup_scaling_and_decay():
    cfg = make("train.epochs=10", "optim.warmup_epochs=2", "optim.lr=0.1")
    steps = 100  # per epoch
    assert lr_at(0, steps, cfg, 4) == pytest.approx(0.1)
    assert lr_at(100, steps, cfg, 4) == pytest.approx(0.25)  # halfway through warm-up
    assert lr_at(200, steps, cfg, 4) == pytest.approx(0.4)  # peak = 0.1 x 4 workers
    assert lr_at(500, steps, cfg, 4) == pytest.approx(0.04)  # first decay at 50%
    assert lr_at(900, steps, cfg, 4) == pytest.approx(0.004)  # second at 83.3%


def test_no_module_of_sparsetrain_imports_hydras_internals():
    """Hydra's public API only (``hydra.compose``, ``hydra.core``): ``hydra._internal`` changes
    without notice between Hydra's releases."""
    from pathlib import Path

    import sparsetrain

    root = Path(sparsetrain.__file__).parent
    users = [p.relative_to(root.parent).as_posix() for p in sorted(root.rglob("*.py"))
             if "hydra._internal" in p.read_text()]
    assert users == []


def test_a_fixed_global_batch_splits_over_the_ranks():
    """experiment=tta_workers keeps the global batch (128) and the peak lr as the ranks change;
    a world size that does not divide the batch stops with one line that names both."""
    for world, per_rank in ((2, 64), (4, 32), (8, 16)):
        cfg = make("experiment=tta_workers", f"world_size={world}")
        validate(cfg, env={})
        assert (cfg.train.batch_size, cfg.optim.lr, cfg.optim.scale_lr) == (per_rank, 0.1, False)
    with pytest.raises(ConfigError) as info:
        validate(make("experiment=tta_workers", "world_size=3"), env={})
    assert str(info.value) == ("a global batch of 128 does not split over world_size=3 ranks; "
                               "allowed: a world_size that divides 128")
