"""A researcher's own compressor, kept outside the checkout (issue 35, "A researcher's trial"):
a module and a scheme yaml in their own folder, found through ``--config-dir`` or
``hydra.searchpath``; its options are part of what a run is; mistakes point the right way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import ROOT, TINY, read_json, run_cli

SCHEME_YAML = """\
defaults:
  - base_scheme
  - _self_
name: rrandk
compressor:
  _target_: mypkg.RRandK
  _partial_: true
"""
MODULE = """\
from sparsetrain.compress import RandomK


class RRandK(RandomK):
    def __init__(self, ratio, layout, scope="layerwise", *, rescale: bool = True, **kw):
        super().__init__(ratio, layout, scope, **kw)
        self.rescale = rescale
"""


@pytest.fixture
def mine(tmp_path) -> Path:
    """``mine/conf/scheme/rrandk.yaml`` and ``mine/mypkg.py`` under ``tmp_path`` (the cwd of the
    commands); also ``mine/mycfg/`` (a package holding the same yaml, for ``pkg://``)."""
    folder = tmp_path / "mine"
    (folder / "conf" / "scheme").mkdir(parents=True)
    (folder / "conf" / "scheme" / "rrandk.yaml").write_text(SCHEME_YAML)
    (folder / "mypkg.py").write_text(MODULE)
    (folder / "mycfg" / "scheme").mkdir(parents=True)
    (folder / "mycfg" / "__init__.py").write_text("")
    (folder / "mycfg" / "scheme" / "rrandk.yaml").write_text(SCHEME_YAML)
    return folder


def _mine_env() -> dict:
    """PYTHONPATH=mine (relative, as a researcher types it), this checkout first."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), "mine"])}


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# ---- 1. the search path ------------------------------------------------------------------------
def test_the_pre_check_reads_the_search_path_hydra_will(mine, monkeypatch):
    from sparsetrain.config import check_overrides, group_options, help_text, search_dirs

    conf = (mine / "conf").resolve()
    monkeypatch.chdir(mine.parent)
    monkeypatch.syspath_prepend(str(mine))
    for args in (["--config-dir", "mine/conf"], ["-cd", str(conf)], [f"--config-dir={conf}"],
                 [f"hydra.searchpath=[file://{conf}]"], ["hydra.searchpath=[pkg://mycfg]"]):
        dirs = search_dirs(args)
        assert [d.name for d in dirs] == ["mycfg" if "pkg://" in args[0] else "conf"], args
        assert "rrandk" in group_options("scheme", dirs) and "topk" in group_options("scheme", dirs)
        check_overrides([*args, "scheme=rrandk", "scheme.compressor.rescale=false"])
        check_overrides([*args, "-m", "scheme=rrandk,topk"])
    assert search_dirs(["scheme=topk"]) == () and "rrandk" not in group_options("scheme")
    assert "rrandk" in help_text(search_dirs(["--config-dir", "mine/conf"]))


@pytest.mark.parametrize("where", ["--config-dir", pytest.param("hydra.searchpath", marks=pytest.mark.slow)])
def test_a_scheme_outside_the_checkout_runs_end_to_end(mine, where):
    tmp = mine.parent
    found = (["--config-dir", "mine/conf"] if where == "--config-dir"
             else [f"hydra.searchpath=[file://{mine / 'conf'}]"])
    proc = run_cli(*found, *TINY, "scheme=rrandk", "world_size=2", "train.max_steps=4", "hydra.run.dir=run",
                   cwd=tmp, env=_mine_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(tmp / "run" / "summary.json")
    assert s["status"] == "completed" and s["steps"] == 4, s
    assert s["config"]["scheme"]["name"] == "rrandk"
    assert s["config"]["scheme"]["compressor"]["_target_"] == "mypkg.RRandK"
    # which version of one's own class ran (issue 62): its file, digested; the summary's layout
    code = s["compressor_code"]
    assert code["target"] == "mypkg.RRandK" and code["files"] == ["mine/mypkg.py"]
    assert len(code["digest"]) == 16 and s["schema_version"] == 1


# ---- 2. a compressor's options are part of what a run is -----------------------------------------
def test_config_differences_count_the_compressors_options():
    from sparsetrain.train.checkpoint import config_differences

    def blockk(size=256, **options):  # scheme.block_size, and the options set through the node
        node = {"_target_": "sparsetrain.compress.BlockRandomK", "_partial_": True, **options}
        return {"scheme": {"name": "blockk", "block_size": size, "compressor": node}}

    # an option set only through the node is a difference; left out, it is the class's default
    assert config_differences(blockk(), blockk(size=256)) == []
    assert config_differences(blockk(), blockk(block_size=64)) == [("scheme.compressor.block_size", 256, 64)]
    assert config_differences(blockk(block_size=64), blockk()) == [("scheme.compressor.block_size", 64, 256)]
    assert config_differences(blockk(), blockk(block_size=256)) == []
    # an option the yaml takes from a scheme key is said once, under that key
    assert config_differences(blockk(64, block_size=64), blockk(32, block_size=32)) == [("scheme.block_size", 64, 32)]
    # runs recorded before the node existed: no options to compare
    assert config_differences({"scheme": {"name": "blockk", "block_size": 256}}, blockk(block_size=256)) == []


def test_another_class_of_the_same_scheme_is_another_run(tmp_path):
    """scheme.compressor._target_ (and memory's, sync's) defines the run: a rerun into a completed
    folder and a resume with another class are refused in one line; a checkpoint or summary from
    before the compressor node existed, or another scheme's name, adds no class difference."""
    import json

    from omegaconf import OmegaConf

    from sparsetrain.config import compose
    from sparsetrain.errors import ConfigError
    from sparsetrain.train.checkpoint import check_same_run, completed_run, config_differences

    def config(*overrides):
        return OmegaConf.to_container(compose(["scheme=topk", "train.max_steps=4", *overrides]), resolve=True)

    topk, randk = config(), config("scheme.compressor._target_=sparsetrain.compress.RandomK")
    assert config_differences(topk, randk) == [
        ("scheme.compressor._target_", "sparsetrain.compress.TopK", "sparsetrain.compress.RandomK")]
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", "config": topk}))
    with pytest.raises(ConfigError) as err:
        completed_run(tmp_path, randk)
    assert "scheme.compressor._target_='sparsetrain.compress.TopK' there, 'sparsetrain.compress.RandomK' now" \
        in str(err.value) and "\n" not in str(err.value)
    assert completed_run(tmp_path, topk)["status"] == "completed"
    with pytest.raises(ConfigError, match=r"will not resume .*scheme.compressor._target_="):
        check_same_run(topk, randk, "run/checkpoint.pt")
    # the memory and the sync node: another class, or one added or taken away
    node = {"_target_": "mymem.RampEF", "_partial_": True}
    for key in ("memory", "sync"):
        own = {**topk, "scheme": {**topk["scheme"], key: node}}
        assert config_differences(topk, own) == [(f"scheme.{key}._target_", None, "mymem.RampEF")]
        assert config_differences(own, topk) == [(f"scheme.{key}._target_", "mymem.RampEF", None)]
    # recorded before the compressor node: the class is the scheme's; another name says it alone
    old = {**topk, "scheme": {k: v for k, v in topk["scheme"].items() if k != "compressor"}}
    assert config_differences(old, topk) == [] == config_differences(topk, old)
    assert [k for k, *_ in config_differences(topk, {**randk, "scheme": {**randk["scheme"], "name": "randk"}})] == [
        "scheme.name"]


OWN_MEMORY = """\
from sparsetrain.compress import Memory


class EF(Memory):
    BUFFERS = ("memory",)

    def accumulate(self, grad):
        return self.add_into(self.memory, grad)

    def forget(self, payload, compressor):
        compressor.forget(self.memory, payload)
"""


@pytest.fixture
def own_memory(tmp_path, monkeypatch):
    """``ownmem.py`` (``OWN_MEMORY``) under ``tmp_path``, importable, imported afresh."""
    import sys

    (tmp_path / "ownmem.py").write_text(OWN_MEMORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("ownmem", None)
    yield tmp_path / "ownmem.py"
    sys.modules.pop("ownmem", None)


def _own_memory_config(*overrides):
    from omegaconf import OmegaConf

    from sparsetrain.config import compose, validate

    cfg = compose([*TINY, "scheme=randk", "scheme.memory={_target_:ownmem.EF,_partial_:true}", "world_size=1",
                   "train.max_steps=2", *overrides])
    validate(cfg)
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))


def test_own_code_is_kept_in_the_checkpoint_and_another_version_is_refused(tmp_path, own_memory):
    """The source of the scheme's own classes (here a memory: every out-of-tree _target_ counts) is
    kept in the run record's checkpoint state; a resume on another version of it is refused in one
    line, before any rank starts and in the trainer, unless train.allow_code_change=true, which
    records both versions."""
    import torch
    from omegaconf import OmegaConf

    from sparsetrain.errors import ConfigError
    from sparsetrain.rank import RankInfo
    from sparsetrain.train import checkpoint as ckpt
    from sparsetrain.train.record import RunRecord

    run = tmp_path / "run"
    run.mkdir()

    def record(*overrides):  # the run record alone: what it keeps and checks needs no trainer
        return RunRecord(_own_memory_config(*overrides), RankInfo(0, 1, 0, 1, "single"), run,
                         torch.device("cpu"), parts=None, tally=None)

    first = record()
    v1 = first.own_code
    assert v1["targets"] == ["ownmem.EF"] and v1["files"][-1].endswith("ownmem.py")
    config = OmegaConf.to_container(first.cfg, resolve=True)
    ckpt.save({"step": 1, "per_rank": [{}], "config": config, **first.state_dict()}, first.checkpoint_path)
    ckpt.check_resume(run, config)  # the same version resumes
    own_memory.write_text(OWN_MEMORY + "# edited\n")
    second = record()
    v2 = second.own_code["digest"]
    assert v2 != v1["digest"]
    for refuse in (second.load_checkpoint, lambda: ckpt.check_resume(run, config)):
        with pytest.raises(ConfigError) as err:
            refuse()
        line = str(err.value)
        assert f"ownmem.EF@{v1['digest']}" in line and f"ownmem.EF@{v2}" in line and "\n" not in line
        assert "train.allow_code_change=true" in line
    ckpt.check_resume(run, {**config, "train": {**config["train"], "allow_code_change": True}})
    allowed = record("train.allow_code_change=true")
    allowed.load_state_dict(allowed.load_checkpoint())
    assert allowed.state_dict()["compressor_code_versions"] == [v1["digest"], v2]


def test_a_run_resumed_on_another_version_of_own_code_is_its_own_row():
    from sparsetrain.analysis.loader import row_from_summary

    config = {"scheme": {"name": "randk"}, "scope": {"name": "layerwise"}, "aggregation": {"name": "allgather"}}
    code = {"target": "own.EF", "files": ["own.py"], "digest": "b" * 16}
    row = row_from_summary({"status": "completed", "config": config, "compressor_code": code}, None)
    assert row["compressor_code"] == "b" * 16
    resumed = {"status": "completed", "config": config, "compressor_code": code,
               "compressor_code_versions": ["a" * 16, "b" * 16]}
    assert row_from_summary(resumed, None)["compressor_code"] == f"{'a' * 16};{'b' * 16}"


@pytest.mark.slow  # three trainers and a run
def test_own_code_edited_between_interrupt_and_resume_is_refused_unless_allowed(tmp_path, own_memory):
    """The same through the trainer: refused, then with train.allow_code_change=true resumed, the
    summary lists both versions and the analysis keeps the run apart from either."""
    import torch
    from omegaconf import OmegaConf

    from sparsetrain.analysis.loader import load_runs
    from sparsetrain.errors import ConfigError
    from sparsetrain.rank import RankInfo
    from sparsetrain.train import Trainer
    from sparsetrain.train.checkpoint import check_resume

    run = tmp_path / "run"

    def trainer(*overrides):
        return Trainer(_own_memory_config(*overrides), RankInfo(0, 1, 0, 1, "single"), run, torch.device("cpu"))

    first = trainer()
    v1 = first.record.own_code
    assert v1["targets"] == ["ownmem.EF"] and v1["files"][-1].endswith("ownmem.py")
    first.save_checkpoint()  # as an interruption would
    own_memory.write_text(OWN_MEMORY + "# edited\n")
    second = trainer()
    v2 = second.record.own_code["digest"]
    assert v2 != v1["digest"]
    config = OmegaConf.to_container(second.cfg, resolve=True)
    for refuse in (second.record.load_checkpoint, lambda: check_resume(run, config)):
        with pytest.raises(ConfigError) as err:
            refuse()
        line = str(err.value)
        assert f"ownmem.EF@{v1['digest']}" in line and f"ownmem.EF@{v2}" in line and "\n" not in line
        assert "train.allow_code_change=true" in line
    check_resume(run, {**config, "train": {**config["train"], "allow_code_change": True}})
    summary = trainer("train.allow_code_change=true").fit()
    assert summary["resumed_from_step"] == 0 and summary["compressor_code"]["digest"] == v2
    assert summary["compressor_code_versions"] == [v1["digest"], v2]
    assert load_runs(run)["compressor_code"].tolist() == [f"{v1['digest']};{v2}"]


@pytest.mark.slow  # three runs
def test_a_rerun_with_another_compressor_option_is_refused_and_analysed_apart(mine):
    from sparsetrain.analysis.loader import load_runs

    tmp = mine.parent
    base = ["--config-dir", "mine/conf", *TINY, "scheme=rrandk", "world_size=1", "train.max_steps=2"]
    for folder, option in (("runs/a", []), ("runs/b", ["scheme.compressor.rescale=false"])):
        proc = run_cli(*base, *option, f"hydra.run.dir={folder}", cwd=tmp, env=_mine_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_json(tmp / "runs/b/summary.json")["config"]["scheme"]["compressor"]["rescale"] is False

    refused = run_cli(*base, "scheme.compressor.rescale=false", "hydra.run.dir=runs/a", cwd=tmp,
                      env=_mine_env(), timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    (line,) = _error_lines(refused.stderr)
    assert "holds a completed run of a different configuration: scheme.compressor.rescale=True there, False now" in line
    assert "already completed" not in refused.stdout
    same = run_cli(*base, "scheme.compressor.rescale=true", "hydra.run.dir=runs/a", cwd=tmp,
                   env=_mine_env(), timeout=300)  # the class's default, said out loud: the same run
    assert same.returncode == 0 and "already completed" in same.stdout, same.stderr[-3000:]

    runs = load_runs(tmp / "runs")
    assert sorted(runs["compressor_options"]) == ["defaults", "rescale=False"]


def test_the_analysis_has_the_options_column_only_where_a_run_set_one(tmp_path):
    from sparsetrain.analysis.loader import _axes_from_config

    node = {"_target_": "sparsetrain.compress.BlockRandomK", "_partial_": True, "block_size": 64}
    assert _axes_from_config({"scheme": {"name": "blockk", "block_size": 64, "compressor": node}})[
        "compressor_options"] is None  # the scheme key's axis already
    assert _axes_from_config({"scheme": {"name": "blockk", "block_size": 256, "compressor": node}})[
        "compressor_options"] == "block_size=64"


@pytest.mark.slow  # reads every committed run
def test_the_committed_studies_have_no_options_column():
    from sparsetrain.analysis.loader import load_runs

    assert "compressor_options" not in load_runs(ROOT / "results").columns


# ---- 3. errors that point the right way --------------------------------------------------------
def test_compressor_option_mistakes_say_where_options_go(mine, monkeypatch):
    from sparsetrain.config import ConfigError, check_overrides

    monkeypatch.chdir(mine.parent)
    monkeypatch.syspath_prepend(str(mine))
    cd = ["--config-dir", "mine/conf"]
    refused = {
        (*cd, "scheme=rrandk", "scheme.rescale=false"):
            "scheme.rescale=false: there is no key 'scheme.rescale'; compressor options go under "
            "scheme.compressor.<option>: scheme.compressor.rescale=false",
        ("scheme=randk", "scheme.rescale=false"):
            "scheme.rescale=false: there is no key 'scheme.rescale'; scheme=randk's compressor "
            "sparsetrain.compress.RandomK takes no options (scheme.compressor.<option>=...)",
        ("scheme=blockk", "scheme.block_sise=64"): "did you mean scheme.block_size=64?",
        (*cd, "scheme=rrandk", "scheme.compressor.nope=1"):
            "scheme.compressor.nope=1: mypkg.RRandK takes no argument 'nope'; it takes rescale",
        ("-m", "scheme=blockk,topk", "scheme.compressor.block_size=64"):
            "sparsetrain.compress.TopK takes no argument 'block_size'; it takes no options",
        ("scheme.compressor.rescale=false",): "scheme=none has no compressor",
    }
    for args, needle in refused.items():
        with pytest.raises(ConfigError) as info:
            check_overrides(list(args))
        assert needle in str(info.value) and "\n" not in str(info.value), (args, str(info.value))
        assert "scheme.rank" not in str(info.value)
    check_overrides(["scheme=blockk", "scheme.compressor.block_size=64"])


def test_an_unknown_compressor_argument_stops_before_any_rank_starts(mine):
    proc = run_cli("--config-dir", "mine/conf", *TINY, "scheme=rrandk", "scheme.compressor.nope=1",
                   cwd=mine.parent, env=_mine_env(), timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == ("error: scheme.compressor.nope=1: mypkg.RRandK takes no argument 'nope'; "
                                   "it takes rescale (scheme.compressor.<option>=...)")
    assert not (mine.parent / "outputs").exists()


@pytest.mark.slow
def test_a_module_off_pythonpath_is_named_in_one_line(mine):
    proc = run_cli("--config-dir", "mine/conf", *TINY, "scheme=rrandk", "hydra.run.dir=run",
                   cwd=mine.parent, timeout=120)  # PYTHONPATH without mine
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = _error_lines(proc.stderr)
    assert ("cannot import mypkg for scheme.compressor._target_=mypkg.RRandK: No module named 'mypkg'; "
            "is its folder on PYTHONPATH?") in line
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
    assert not (mine.parent / "run" / "ranks").exists()  # no rank started


def test_the_resume_command_keeps_pythonpath_and_the_config_dir(monkeypatch, tmp_path):
    from sparsetrain.launch import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_argv", ["--config-dir", "mine/conf", "scheme=rrandk", "debug=tiny"])
    monkeypatch.setenv("PYTHONPATH", "mine")
    command = cli._resume_command(tmp_path / "outputs" / "run", multirun=False)
    assert command.startswith("PYTHONPATH=mine ") and " -m sparsetrain.run --config-dir mine/conf scheme=rrandk " in command
    assert command.endswith(" hydra.run.dir=outputs/run"), command
    monkeypatch.delenv("PYTHONPATH")
    assert not cli._resume_command(tmp_path / "outputs" / "run", multirun=False).startswith("PYTHONPATH")


# ---- 4. a quantizer of one's own (issue 62) ----------------------------------------------------
NATURAL_YAML = """\
defaults:
  - base_scheme
  - _self_
name: natural
compressor:
  _target_: natural.Natural
  _partial_: true
"""


def _docs_quantizer() -> str:
    """docs/own_compressor.md's natural-compression quantizer, as written there."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "own_compressor.md").read_text(), flags=re.S)
    (code,) = [b for b in blocks if "class Natural(Quantizer)" in b]
    return code


def test_a_quantizer_written_from_the_docs_trains_through_the_trainer(tmp_path, monkeypatch):
    """The docs' 9-bit quantizer (encode and decode_add, nothing else): validated, then a few
    steps of the trainer, whose gathered messages go through decode_add (9 bits: no compiled
    decode), and what it decodes is unbiased."""
    import math

    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from sparsetrain.compress import Layout, packed_nbytes
    from sparsetrain.config import CONF_DIR, register, validate
    from sparsetrain.rank import RankInfo
    from sparsetrain.train import Trainer

    (tmp_path / "conf" / "scheme").mkdir(parents=True)
    (tmp_path / "conf" / "scheme" / "natural.yaml").write_text(NATURAL_YAML)
    (tmp_path / "natural.py").write_text(_docs_quantizer())
    monkeypatch.syspath_prepend(str(tmp_path))
    from natural import Natural

    q = Natural(1.0, Layout.from_sizes([5, 700, 3]))
    assert q.fused_decode is False and q.num_positions == packed_nbytes(708, 9)
    x = torch.randn(q.numel, dtype=torch.float64)
    x[3] = 0
    mean = torch.zeros_like(x)
    for seed in range(400):
        sent = q.compress(x, seed)
        one = q.decompress(sent.values, sent.positions)
        assert torch.equal(one[3], one.new_zeros(())) and torch.equal(one.sign(), x.sign())
        mean += one / 400
    assert (mean - x).abs().max() < 0.2 * x.abs().max()  # unbiased: the mean of 400 draws near x
    memory = x.clone()
    q.forget(memory, sent)
    assert torch.equal(memory, x - one)  # error feedback: acc - decoded, exactly

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"hydra.searchpath=[file://{tmp_path / 'conf'}]", *TINY, "scheme=natural", "world_size=1",
            "train.max_steps=3", "train.checkpoint=false", "train.eval_every=1"])
    validate(cfg)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    trainer = Trainer(cfg, RankInfo(0, 1, 0, 1, "single"), tmp_path / "run", torch.device("cpu"))
    compressor = trainer.reducer.compressor
    assert type(compressor).__name__ == "Natural" and compressor.fused_decode is False
    trainer.fit()
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["status"] == "completed" and summary["steps"] == 3, summary
    assert math.isfinite(summary["train_loss_final"]), summary


BYTE_QUANTIZER = """\
import torch

from sparsetrain.compress import Quantizer


class Bytes(Quantizer):
    '''The sign and 7 bits of |acc| over its tensor's largest, rounded down: 8 bits an entry.'''
    bits_per_entry = 8

    def encode(self, acc, seed, values, wire):
        values.copy_(self.per_segment(acc, lambda t: t.abs().max()))
        scale = values.to(acc.dtype)[self.entry_table("segment", acc.device)]
        level = torch.where(scale > 0, acc.abs() / scale * 127, 0).floor().to(torch.int32)
        wire.copy_(level | (acc < 0).int() << 7)

    def decode_add(self, values, wire, out):
        code = wire.to(torch.int32)
        mag = (code & 127).to(out.dtype) / 127 * values[self.entry_table("segment", out.device)]
        out.add_(torch.where(code >= 128, -mag, mag))


class NoDecode(Quantizer):
    bits_per_entry = 8
    encode = Bytes.encode


class FusedWithoutDecodeMany(Bytes):
    fused_decode = True


class NoEncode(Quantizer):
    def decode_add(self, values, wire, out):
        pass


class NoBits(Bytes):
    bits_per_entry = 0
"""


@pytest.fixture
def quantizers(tmp_path, monkeypatch):
    """``myq``: an 8-bit quantizer with encode and decode_add, and variants that lack a part."""
    (tmp_path / "myq.py").write_text(BYTE_QUANTIZER)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import myq

    return importlib.reload(myq)


def test_a_quantizer_without_decode_many_decodes_gathered_messages_one_by_one(quantizers):
    """8 bits an entry, on the CPU with the compiled kernels in use: the gathered messages go
    through decode_add, in rank order (the class has no decode_many to fuse them)."""
    import torch

    from sparsetrain.compress import Layout

    q = quantizers.Bytes(1.0, Layout.from_sizes([9, 40]))
    sent = [q.compress(torch.randn(q.numel), seed) for seed in range(3)]
    messages = [(p.values / 3, p.positions, None) for p in sent]
    loop = torch.zeros(q.numel)
    for values, wire, _ in messages:
        q.decompress_add(values, wire, loop)
    assert torch.equal(q.decompress_many(messages, torch.zeros(q.numel)), loop)
    assert q.fused_decode is False


def test_a_quantizer_missing_a_method_says_which_in_one_line(quantizers):
    """Before any rank starts (validate's build of the compressor node) and at construction:
    one line naming the class and what it must implement."""
    from omegaconf import OmegaConf

    from sparsetrain.compress import Layout
    from sparsetrain.config import ConfigError
    from sparsetrain.config.validation import scheme_compressor

    layout = Layout.from_sizes([9, 40])
    wanted = {
        "NoDecode": "NoDecode must implement decode_add(values, wire, out): out += the message, decoded",
        "NoEncode": "NoEncode must implement encode(acc, seed, values, wire): fill values",
        "FusedWithoutDecodeMany": "FusedWithoutDecodeMany must implement decode_many(values, wires, out) "
                                  "or set fused_decode = False",
    }
    for name, needle in wanted.items():
        with pytest.raises(TypeError) as built:
            getattr(quantizers, name)(1.0, layout)
        assert needle in str(built.value) and "\n" not in str(built.value), str(built.value)
        node = {"name": "mine", "compressor": {"_target_": f"myq.{name}", "_partial_": True}}
        with pytest.raises(ConfigError) as checked:
            scheme_compressor(OmegaConf.create(node))
        assert str(checked.value).startswith(f"scheme.compressor._target_=myq.{name} is not allowed: {needle}")
        assert "\n" not in str(checked.value)
    with pytest.raises(ValueError, match=r"^NoBits.bits_per_entry=0 is not allowed; it must be an integer >= 1"):
        quantizers.NoBits(1.0, layout)
    scheme_compressor(OmegaConf.create({"name": "mine", "compressor": {"_target_": "myq.Bytes", "_partial_": True}}))


def test_a_subclass_that_changes_the_codes_does_not_inherit_decode_many():
    """A SignSGD or QSGD subclass that overrides ``encode`` or ``decode_add`` decodes through its
    own ``decode_add``, not the base's ``decode_many`` (which would decode the base's codes, on
    the CPU with numba only, while error feedback subtracts ``decode_add``'s): the update is what
    the memory forgets. One that defines ``decode_many`` itself keeps the fused pass."""
    import torch

    from sparsetrain.comm.sparse import SparseReducer
    from sparsetrain.compress import QSGD, SignSGD
    from sparsetrain.timing import NULL_TIMER

    class DoubledScaleSign(SignSGD):  # sends 2x the scale, decodes half of it: consistent alone
        def encode(self, acc, seed, values, wire):
            super().encode(acc, seed, values, wire)
            values.mul_(2.0)

        def decode_add(self, values, wire, out):
            super().decode_add(values * 0.5, wire, out)

    class OwnEncodeQSGD(QSGD):
        def encode(self, acc, seed, values, wire):
            super().encode(acc, seed, values, wire)

    class OwnFusedSign(DoubledScaleSign):  # says its decode_many is right for its codes
        decode_many = SignSGD.decode_many

    layout = [4096, 1000]
    assert SignSGD(1.0, layout).fused_decode and QSGD(1.0, layout).fused_decode  # the built-ins keep it
    assert DoubledScaleSign(1.0, layout).fused_decode is False
    assert OwnEncodeQSGD(1.0, layout).fused_decode is False
    assert OwnFusedSign(1.0, layout).fused_decode is True
    for cls in (DoubledScaleSign, OwnEncodeQSGD):
        red = SparseReducer(cls(1.0, layout), aggregation="allgather", world_size=1, rank=0, seed=0,
                            dtype=torch.float64)
        grad = torch.randn(5096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        update = grad.clone()
        red.reduce(update, 0, NULL_TIMER)
        torch.testing.assert_close(update, grad - red.memory.memory, rtol=1e-12, atol=1e-12)
