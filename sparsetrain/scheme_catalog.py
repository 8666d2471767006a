"""What the analysis and the results files know of each scheme, read from conf/: how tables and
figures show it and what a recorded config does not say (conf/schemes.yaml), and the keys a
scheme has of its own (conf/scheme/<name>.yaml). No scheme names in code: a scheme that neither
file knows (one's own, in another config folder) has none of the properties and is shown by its
name. No torch, no Hydra: plain yaml."""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

#: the scheme name of dense SGD (plain data-parallel AllReduce, no compressor): the one spelling
#: every layer tests through ``is_dense``
DENSE = "none"

CONF_DIR = (Path(__file__).resolve().parent / "_conf").resolve()  # conf/, as config.schema finds it
# The keys every scheme has (SchemeConfig's) and a yaml's own bookkeeping: not a scheme's own keys.
_COMMON = ("defaults", "name", "compressor", "error_feedback", "uncompressed", "warmup_steps")


def is_dense(scheme_name) -> bool:
    """Whether ``scheme_name`` names dense SGD (``DENSE``); False for None and every other name."""
    return scheme_name == DENSE


def exchange_scheme(scheme_name, *, has_compressor: bool, synchronises: bool):
    """The scheme whose exchange runs: ``DENSE`` for one that synchronises every ``period`` steps
    without a compressor (local SGD, DiLoCo: the pseudo-gradient averaged densely), else itself."""
    return DENSE if synchronises and not has_compressor else scheme_name


@functools.cache
def table() -> dict[str, dict]:
    """conf/schemes.yaml: each scheme's entry, in the tables' order."""
    path = CONF_DIR / "schemes.yaml"
    return {str(k): dict(v or {}) for k, v in (yaml.safe_load(path.read_text()) or {}).items()}


def info(scheme) -> dict:
    """The scheme's entry in conf/schemes.yaml ({} for one not listed)."""
    return table().get(scheme, {})


def with_property(key: str) -> tuple[str, ...]:
    """The schemes whose entry sets ``key`` (``torch_hook``), in the table's order."""
    return tuple(name for name, entry in table().items() if entry.get(key))


@functools.cache
def own_keys(scheme) -> frozenset[str]:
    """The keys conf/scheme/<scheme>.yaml has beyond every scheme's (``rank``) or passes to its class
    from the scheme's node (``block_size: ${..block_size}``); empty for a scheme not in conf/."""
    path = CONF_DIR / "scheme" / f"{scheme}.yaml"
    node = yaml.safe_load(path.read_text()) if isinstance(scheme, str) and path.is_file() else None
    if not isinstance(node, dict):
        return frozenset()
    keys = {k for k in node if k not in _COMMON}
    compressor = node.get("compressor")
    if isinstance(compressor, dict):
        keys |= {v[4:-1] for v in compressor.values() if isinstance(v, str) and v.startswith("${..")}
    return frozenset(keys)


def formerly(name, has_compressor: bool):
    """The scheme a run recorded as ``name`` ran: the one whose entry says ``formerly: <name>`` when
    the run recorded no compressor node, else ``name`` itself."""
    if not has_compressor and name is not None:
        for scheme, entry in table().items():
            if "formerly" in entry and entry["formerly"] == name:
                return scheme
    return name
