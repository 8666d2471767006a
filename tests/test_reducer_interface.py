"""The reducer interface is explicit (issue 62): the trainer, its step and its record read every
member of ``comm.Reducer`` directly, never through ``getattr`` / ``hasattr`` probes; every reducer
class is a ``comm.ReducerBase`` with every member; a reducer that lacks one is refused when the
exchange is built, in one line."""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import re
import textwrap
from functools import partial

import pytest
import torch
from conftest import ROOT, TINY
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from sparsetrain.comm import DenseReducer, Reducer, ReducerBase, build_reducer, check_reducer
from sparsetrain.comm.periodic import PeriodicSync
from sparsetrain.comm.protocol import REDUCER_MEMBERS
from sparsetrain.compress import QSGD, BlockRandomK, Layout
from sparsetrain.config import CONF_DIR, register
from sparsetrain.errors import ConfigError
from sparsetrain.timing import NULL_TIMER
from sparsetrain.train import components

FOLDERS = ("train", "comm")  # where the reducers live and who reads them
# a probe's first argument that names a reducer (the trainer's, a record's, an inner one, a bucket's)
REDUCER_NAMES = re.compile(r"(^|\.)(reducer|red|inner|gradients)$")


def _sources():
    for folder in FOLDERS:
        yield from sorted((ROOT / "sparsetrain" / folder).rglob("*.py"))


def test_no_getattr_or_hasattr_probe_on_a_reducer_in_train_and_comm():
    probes = []
    for path in _sources():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):  # the one check of the members (protocol.check_reducer) asks hasattr
            if isinstance(fn, ast.FunctionDef) and fn.name == "check_reducer":
                fn.body = []
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args
                    and REDUCER_NAMES.search(ast.unparse(node.args[0]))):
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, "reducer members read through probes: " + "; ".join(probes)


def _reducer_classes() -> dict[str, type]:
    """Every class defined in train/ and comm/ with a ``reduce`` method of its own (the protocol aside)."""
    found = {}
    for path in _sources():
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == name and callable(vars(cls).get("reduce")) \
                    and cls is not Reducer:  # the protocol itself
                found[cls.__qualname__] = cls
    return found


def _set_in_init(cls: type) -> set[str]:
    """The attributes ``cls.__init__`` (and its bases') assign on ``self``."""
    names = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not hasattr(init, "__code__"):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                        names.add(el.attr)
    return names


def test_every_reducer_class_is_a_reducer_base_with_every_member():
    classes = _reducer_classes()
    assert {"DenseReducer", "SparseReducer", "PeriodicSync", "DDPExchange"} <= set(classes), sorted(classes)
    for name, cls in classes.items():
        assert issubclass(cls, ReducerBase), f"{name} is not a ReducerBase"
        missing = [m for m in REDUCER_MEMBERS if not hasattr(cls, m) and m not in _set_in_init(cls)]
        assert not missing, f"{name} lacks the Reducer members {missing}"


def _params():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    return net, [p for p in net.parameters() if p.requires_grad]


def test_built_reducers_satisfy_the_protocol_and_read_their_defaults_directly():
    net, params = _params()
    numel = sum(p.numel() for p in params)
    dense = DenseReducer(numel)
    sparse = build_reducer("blockk", "layerwise", "allgather", 0.5, Layout.from_sizes([numel]),
                           world_size=1, rank=0, seed=0, compressor=partial(BlockRandomK, block_size=2))
    quantized = build_reducer("qsgd", "layerwise", "allgather", 0.5, Layout.from_sizes([numel]),
                              world_size=1, rank=0, seed=0, compressor=QSGD)
    local = PeriodicSync(params, list(net.buffers()), DenseReducer(numel), period=2)
    compressed_local = PeriodicSync(params, list(net.buffers()), quantized, period=2)
    for red in (dense, sparse, local, compressed_local):
        assert isinstance(red, Reducer) and check_reducer(red, "test") is red
        assert isinstance(red.synchronised(), contextlib.AbstractContextManager)
    # the record's defaults, as the probes gave them before (summary.json unchanged)
    assert (dense.compresses, dense.ratio_applies, dense.aggregation_applies, dense.scope_applies) == \
        (False, True, True, True)
    assert (dense.ranks_diverge, dense.overlap_buckets, dense.sync_summary()) == (False, None, None)
    assert sparse.compresses and sparse.ratio_applies and sparse.aggregation_applies and sparse.scope_applies
    assert dense.after_optimizer(0, NULL_TIMER) is None and dense.settle(torch.zeros(1)) is None
    # local SGD over a dense exchange: none of the run's axes change what is sent
    assert (local.compresses, local.ratio_applies, local.aggregation_applies, local.scope_applies) == \
        (False, False, False, False)
    # over a quantizer: its own word (ratio does not apply to QSGD)
    assert (compressed_local.compresses, compressed_local.ratio_applies, compressed_local.scope_applies) == \
        (True, False, True)
    assert local.ranks_diverge and local.sync_summary()["period"] == 2 and local.overlap_buckets is None


def _cfg(*overrides):
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*TINY, "world_size=1", *overrides])
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))


class _NoAfterOptimizer:
    """A reducer written before the interface was explicit: no ``ReducerBase``, no optional members."""

    def __init__(self, red):
        self.red = red
        for name in ("numel", "collective", "density", "warmup_steps", "bytes_sent_per_step",
                     "dense_bytes_per_step", "uncompressed_bytes_per_step"):
            setattr(self, name, getattr(red, name))

    def reduce(self, flat, step, timer, want_stats=False):
        return self.red.reduce(flat, step, timer, want_stats)

    def attach(self, params, flat_grad, **buckets):
        return self

    def detach(self):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("scheme", ["none", "localsgd"])
def test_exchange_from_config_checks_its_reducer(scheme, monkeypatch):
    cfg = _cfg(f"scheme={scheme}")
    net, _ = _params()
    built = components.exchange_from_config(cfg, net, world_size=1, rank=0)
    assert isinstance(built.reducer, ReducerBase)
    real = components.build_exchange

    def without_members(*args, **kwargs):
        flat, params, red = real(*args, **kwargs)
        return flat, params, _NoAfterOptimizer(red)

    monkeypatch.setattr(components, "build_exchange", without_members)
    if scheme == "localsgd":  # the periodic exchange reads its inner reducer's members
        with pytest.raises(AttributeError, match="compresses"):
            components.exchange_from_config(cfg, net, world_size=1, rank=0)
        return
    with pytest.raises(ConfigError) as err:
        components.exchange_from_config(cfg, net, world_size=1, rank=0)
    msg = str(err.value)
    assert "\n" not in msg and "scheme=none" in msg and "_NoAfterOptimizer" in msg
    for member in ("compresses", "ratio_applies", "ranks_diverge", "overlap_buckets", "settle",
                   "after_optimizer", "synchronised", "sync_summary"):
        assert member in msg
    assert "reduce," not in msg and "numel" not in msg
