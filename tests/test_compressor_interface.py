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
