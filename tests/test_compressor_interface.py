"""The compressor interface stays narrow (issue 62): every class attribute it declares acts, the
base class itself keeps its rules (scopes), and docs/own_compressor.md lists exactly what it has."""

import re
import typing
from pathlib import Path

import pytest

from sparsetrain.compress import Compressor, Layout, Quantizer

ROOT = Path(__file__).resolve().parents[1]


def _class_vars(cls) -> list[str]:
    """The ``ClassVar`` attributes ``cls`` itself declares."""
    hints = typing.get_type_hints(cls, include_extras=False)
    return [name for name in vars(cls).get("__annotations__", {})
            if typing.get_origin(hints.get(name)) is typing.ClassVar]


def _sources() -> str:
    """The package's and the examples' code, where a class attribute is read."""
    files = [*sorted((ROOT / "sparsetrain").rglob("*.py")), *sorted((ROOT / "examples").rglob("*.py"))]
    return "\n".join(f.read_text() for f in files)


@pytest.mark.parametrize("cls", [Compressor, Quantizer])
def test_every_declared_class_attribute_is_read_somewhere(cls):
    """A flag nothing reads (the former ``deterministic``, ``sends_entries``) only misleads an
    author: each ClassVar must be read as an attribute (``.name``) or by name (``"name"``)."""
    code = _sources()
    unread = [name for name in _class_vars(cls)
              if not re.search(rf"\.{name}\b|[\"']{name}[\"']", code)]
    assert not unread, f"{cls.__name__} declares {unread}, which nothing reads"


def test_scopes_are_declared_on_the_base():
    assert Compressor.scopes == ("layerwise", "global") and Compressor.scope_reason == ""


def test_the_base_refuses_a_scope_outside_the_class_scopes():
    class LayerwiseOnly(Compressor):
        scopes = ("layerwise",)
        scope_reason = "each tensor is its own matrix"

        def select(self, acc, seed):
            raise AssertionError("not reached")

    LayerwiseOnly(0.5, Layout.from_sizes([4, 6]), "layerwise")  # allowed
    with pytest.raises(ValueError) as info:
        LayerwiseOnly(0.5, Layout.from_sizes([4, 6]), "global")
    assert str(info.value) == ("scope='global' is not allowed for LayerwiseOnly (each tensor is its own matrix); "
                               "allowed: layerwise")


def _built_ones():
    """One of each built-in compressor and the example's integer-sum quantizer, over a small model."""
    import sys
    from functools import partial

    from sparsetrain.compress import (
        QSGD,
        BlockRandomK,
        NoCompression,
        PowerSGD,
        RandomK,
        SignSGD,
        TopK,
    )

    sys.path.insert(0, str(ROOT / "examples" / "thc"))
    try:
        from thc import IntegerSum
    finally:
        sys.path.remove(str(ROOT / "examples" / "thc"))
    shapes = [(8, 3, 3, 3), (8,), (10, 32)]
    layout = Layout.from_sizes([216, 8, 320])
    return [(cls, layout) for cls in (TopK, RandomK, BlockRandomK, NoCompression, SignSGD, QSGD, IntegerSum)] + [
        (partial(PowerSGD, shapes=shapes), layout), (partial(PowerSGD, rank=2, shapes=shapes), layout)]


@pytest.mark.parametrize("factory, layout", _built_ones(), ids=lambda x: getattr(x, "__name__", None) or
                         getattr(getattr(x, "func", None), "__name__", None) or "layout")
def test_k_and_ks_are_set_once_from_segment_ks(factory, layout, monkeypatch):
    """``k``/``ks`` come from ``segment_ks`` in ``Compressor.__init__`` and nothing overwrites them
    afterwards (the quantizers, dense, PowerSGD and the THC example once did)."""
    writes = []
    plain = object.__setattr__

    def tracking(self, name, value):
        if name in ("k", "ks"):
            writes.append(name)
        plain(self, name, value)

    monkeypatch.setattr(Compressor, "__setattr__", tracking, raising=False)
    comp = factory(0.1, layout, "layerwise")
    monkeypatch.undo()
    assert sorted(writes) == ["k", "ks"], f"k/ks written {writes}"
    assert comp.ks == comp.segment_ks(comp.layout) and comp.k == sum(comp.ks)
    if hasattr(comp, "p_numel"):  # PowerSGD: k is both factors' entries
        assert comp.k == comp.p_numel + comp.q_numel


def test_a_subclass_sets_its_counts_through_segment_ks():
    class Halves(Compressor):
        def segment_ks(self, layout):
            return [n // 2 for n in layout.sizes]

        def select(self, acc, seed):
            raise AssertionError("not reached")

    comp = Halves(0.01, Layout.from_sizes([10, 6]))
    assert (comp.ks, comp.k) == ([5, 3], 8)


@pytest.mark.parametrize("name", ["TopK", "SignSGD"])
def test_forget_subtracts_the_decoded_update_where_the_payload_carries_one(name):
    """``Payload.decoded`` (the update every rank decoded) is what the base's and the quantizers'
    ``forget`` subtract, so a compressor that sets it (PowerSGD) needs no ``forget`` of its own."""
    import torch

    import sparsetrain.compress as compress

    comp = getattr(compress, name)(0.5, Layout.from_sizes([4]), "layerwise")
    acc = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64)
    decoded = torch.tensor([0.25, -1.0, 2.0, 0.0], dtype=torch.float64)
    memory = acc.clone()
    comp.forget(memory, compress.Payload(acc[:1], acc.new_empty(0, dtype=torch.int64), None, decoded=decoded))
    assert torch.equal(memory, acc - decoded)


def test_powersgd_forgets_through_the_base():
    from sparsetrain.compress import PowerSGD

    assert "forget" not in vars(PowerSGD)


def _refusing(monkeypatch, cls):
    """Make ``cls.check_options`` refuse everything with a line of its own; return that line."""
    line = f"{cls.__name__}.check_options was asked"

    def refuse(klass, **options):
        raise ValueError(line)

    monkeypatch.setattr(cls, "check_options", classmethod(refuse), raising=False)
    return line


@pytest.mark.parametrize("scheme, name", [("qsgd", "QSGD"), ("blockk", "BlockRandomK"), ("powersgd", "PowerSGD")])
def test_config_checks_a_scheme_options_through_its_class(scheme, name, monkeypatch):
    """One source per option: ``config.validate`` asks the compressor class (``check_options``),
    with the options of the scheme's ``compressor`` node, instead of checks of its own."""
    import sparsetrain.compress as compress
    from sparsetrain.config import ConfigError, compose, validate

    line = _refusing(monkeypatch, getattr(compress, name))
    with pytest.raises(ConfigError) as info:
        validate(compose([f"scheme={scheme}"]), env={})
    assert str(info.value) == line


def test_qsgd_levels_refused_by_the_class_in_config_and_constructor():
    from sparsetrain.compress import QSGD
    from sparsetrain.config import ConfigError, compose, validate

    want = "scheme.levels=0 is not allowed; it must be an integer in [1, 65535]"
    with pytest.raises(ValueError) as direct:
        QSGD.check_options(levels=0)
    with pytest.raises(ConfigError) as config:
        validate(compose(["scheme=qsgd", "scheme.levels=0"]), env={})
    assert str(direct.value) == str(config.value) == want


@pytest.mark.parametrize("name, options", [("QSGD", {"levels": 3}), ("BlockRandomK", {"block_size": 4}),
                                           ("PowerSGD", {"rank": 1, "shapes": [(4, 4)]})])
def test_the_constructor_checks_through_check_options(name, options, monkeypatch):
    import sparsetrain.compress as compress

    line = _refusing(monkeypatch, getattr(compress, name))
    with pytest.raises(ValueError) as info:
        getattr(compress, name)(0.5, Layout.from_sizes([16]), "layerwise", **options)
    assert str(info.value) == line


def test_config_validation_restates_no_scheme_option():
    text = (ROOT / "sparsetrain" / "config" / "validation.py").read_text()
    restated = [key for key in ("levels", "bucket_size", "block_size", "generator") if key in text]
    assert not restated, f"config/validation.py checks {restated} itself; the compressor's check_options is their home"


def test_the_documented_attribute_table_is_the_class_vars_exactly():
    """docs/own_compressor.md's "Class attributes" table lists every ClassVar of ``Compressor``
    and ``Quantizer``, and nothing else, with the class's default."""
    text = (ROOT / "docs" / "own_compressor.md").read_text()
    section = text.split("### Class attributes", 1)[1].split("\n### ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| (.+?) \|", section, re.M)}
    declared = {name: cls for cls in (Quantizer, Compressor) for name in _class_vars(cls)}  # Compressor's default wins
    assert sorted(rows) == sorted(declared)
    for name, default in rows.items():
        assert default == f"`{getattr(declared[name], name)!r}`".replace("'", '"'), name


@pytest.mark.parametrize("scheme", ["blockk", "powersgd", "qsgd"])
def test_a_schemes_option_defaults_agree_between_its_schema_and_its_class(scheme):
    """A scheme option's default is stated twice, in its typed config (config/schema.py, which
    Hydra needs) and in its class's constructor (which the library's users call): the two
    must agree, so a default changed in one place cannot silently differ in the other."""
    import dataclasses
    import inspect

    import yaml

    from sparsetrain.config.overrides import compressor_class
    from sparsetrain.config.schema import SCHEME_SCHEMAS, SchemeConfig

    node = yaml.safe_load((ROOT / "sparsetrain" / "_conf" / "scheme" / f"{scheme}.yaml").read_text())["compressor"]
    params = inspect.signature(compressor_class(node["_target_"])).parameters
    common = {f.name for f in dataclasses.fields(SchemeConfig)}
    options = [f for f in dataclasses.fields(SCHEME_SCHEMAS[scheme]) if f.name not in common and f.name in node]
    assert options, f"scheme={scheme} passes no option of its schema to its class"
    for f in options:
        assert f.default == params[f.name].default, (scheme, f.name, f.default, params[f.name].default)


def test_help_states_qsgds_levels_range_as_the_class_checks_it():
    from sparsetrain.compress import QSGD
    from sparsetrain.config.help import HELP

    assert f"[1, {QSGD.MAX_LEVELS}]" in HELP["scheme.levels"]
