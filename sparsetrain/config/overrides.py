"""The pre-launch check of the command line's overrides (``check_overrides``): an unknown key
(with or without ``+``), a value of the wrong type, an unknown group option or a scheme's own key
with another scheme stops with one line (and a "did you mean"); the config folders Hydra searches
besides conf/ (``search_dirs``); the compressor options' checks against the scheme's class.
"""

from __future__ import annotations

import dataclasses
import difflib
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from sparsetrain.config.schema import (
    CONF_DIR,
    GROUPS,
    SCHEME_SCHEMAS,
    SchemeConfig,
    _typed_schema,
    register,
    schema_keys,
    scheme_options,
)
from sparsetrain.errors import ConfigError


def group_options(group: str, dirs: tuple[Path, ...] = ()) -> list[str]:
    """The options of ``group`` in conf/ and in the extra config folders ``dirs`` (``search_dirs``)."""
    found = set()
    for conf in (CONF_DIR, *dirs):
        root = conf / group
        found.update(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))
    return sorted(found)


def search_dirs(args: list[str]) -> tuple[Path, ...]:
    """The config folders Hydra searches besides conf/, in its order: ``--config-dir``/``-cd``,
    then ``hydra.searchpath=[...]`` of the command line, else conf/config.yaml's own (Hydra reads
    one or the other). ``file://``, ``pkg://`` and plain paths; folders that do not exist are left
    to Hydra to report."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    entries: list[str] = []
    for i, arg in enumerate(args):
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            entries.append(args[i + 1])
        elif arg.startswith(("--config-dir=", "-cd=")):
            entries.append(arg.partition("=")[2])
    searchpath = None
    for arg in args:
        if arg.lstrip("+").startswith("hydra.searchpath="):
            try:
                (override,) = OverridesParser.create().parse_overrides([arg])
                searchpath = override.value()
            except HydraException:
                searchpath = None  # Hydra says what is wrong with it
    if searchpath is None:
        searchpath = OmegaConf.select(OmegaConf.load(CONF_DIR / "config.yaml"), "hydra.searchpath")
    if isinstance(searchpath, (list, tuple)) or OmegaConf.is_list(searchpath):
        entries += [str(e) for e in searchpath]
    dirs = [d for d in map(_search_dir, entries) if d is not None and d.is_dir()]
    return tuple(dict.fromkeys(d for d in dirs if d != CONF_DIR))


def _search_dir(entry: str) -> Path | None:
    """The folder a search path entry names (``pkg://mypkg.conf``: the package's folder)."""
    scheme, sep, rest = entry.partition("://")
    if not sep:
        return Path(entry).resolve()
    if scheme == "file":
        return Path(rest).resolve()
    if scheme == "pkg":
        import importlib.util

        try:
            spec = importlib.util.find_spec(rest.replace("/", "."))
        except (ImportError, ValueError):
            return None
        locations = list(spec.submodule_search_locations or []) if spec else []
        return Path(locations[0]).resolve() if locations else None
    return None  # structured:// and others: no folder


# Keys whose value is free-form (the scheme's class and its options): any key below them is allowed.
FREE_FORM = ("scheme.compressor", "scheme.memory", "scheme.sync")


def _known(key: str, keys: dict[str, Any]) -> bool:
    head = key.split(".")
    if key in keys or key in GROUPS:
        return True
    if any(key.startswith(f"{k}.") for k in FREE_FORM):
        return True
    parent = ".".join(head[:-1])  # an item of a list: optim.milestones.0
    return head[-1].isdigit() and isinstance(keys.get(parent), list)


def did_you_mean(key: str, keys: list[str]) -> str | None:
    """The known key closest to ``key``: one with the same last part in another section
    (train.lr -> optim.lr), else the closest whole name, else the closest last part."""
    leaf = key.rpartition(".")[2]
    same_leaf = [k for k in keys if k.rpartition(".")[2] == leaf]
    if same_leaf:
        return same_leaf[0]
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if close:
        return close[0]
    by_leaf = {k.rpartition(".")[2]: k for k in keys}
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    return by_leaf[close[0]] if close else None


@contextmanager
def _hydra_on_conf():
    """Hydra initialized on conf/ (``hydra.initialize_config_dir``), as ``python -m
    sparsetrain.run`` initializes it; a Hydra initialized before is put back after."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    before = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            yield GlobalHydra.instance()
    finally:
        if before is not None:
            GlobalHydra.instance().clear()
            GlobalHydra.instance().initialize(before)


def _searchpath(dirs: tuple[Path, ...]) -> list[str]:
    """The override that adds the extra config folders ``dirs`` (``search_dirs``: the command
    line's ``--config-dir`` and ``hydra.searchpath``, else conf/config.yaml's own) to Hydra's
    search path, after conf/, where Hydra puts them; [] without any."""
    if not dirs:
        return []
    quoted = ("'file://" + str(d).replace("\\", "\\\\").replace("'", "\\'") + "'" for d in dirs)
    return [f"hydra.searchpath=[{','.join(quoted)}]"]


def _chosen_schemes(overrides: list, multirun: bool, dirs: tuple[Path, ...] = ()) -> list[str]:
    """The scheme(s) a command line runs: its ``scheme=`` (each value of a sweep); without one,
    what ``conf/config.yaml`` and the ``experiment=`` preset choose (a preset's own sweep with
    ``-m``), read from the defaults as Hydra composes them. [] when that cannot be read (Hydra
    then reports what is wrong)."""
    from hydra import compose
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    def values(override, options: list[str]) -> list[str]:
        if override.value_type == ValueType.GLOB_CHOICE_SWEEP:
            return [str(v) for v in override.value().filter(options)]
        if override.is_sweep_override():
            return [str(v) for v in override.sweep_iterator()]
        return [str(override.value())]

    by_key = {o.key_or_group: o for o in overrides if o.package is None and not o.is_delete()}
    if "scheme" in by_key:
        return values(by_key["scheme"], group_options("scheme", dirs))
    presets = values(by_key["experiment"], group_options("experiment", dirs)) if "experiment" in by_key else [None]
    parser = OverridesParser.create()
    out: list[str] = []
    with _hydra_on_conf():
        for preset in presets:
            try:
                cfg = compose("config", [*_searchpath(dirs), *([] if preset in (None, "None", "null")
                                                               else [f"experiment={preset}"])],
                              return_hydra_config=True)
            except Exception:  # noqa: BLE001  (Hydra says what is wrong when it composes)
                return []
            swept = OmegaConf.select(cfg, "hydra.sweeper.params.scheme") if multirun else None
            if swept is not None:
                out += values(parser.parse_overrides([f"scheme={swept}"])[0], group_options("scheme", dirs))
            else:
                out.append(str(cfg.hydra.runtime.choices.scheme))
    return out


def launcher_options(dirs: tuple[Path, ...] = ()) -> list[str]:
    """The options of Hydra's ``hydra/launcher`` group: Hydra's own, the installed plugins', ours
    (and those in the extra config folders ``dirs``)."""
    from hydra.core.plugins import Plugins

    Plugins.instance()  # the plugins register their launchers' configs
    with _hydra_on_conf() as hydra:
        return sorted(hydra.config_loader().get_group_options("hydra/launcher", overrides=_searchpath(dirs)))


def check_overrides(args: list[str]) -> None:
    """Check the command line's overrides before Hydra composes them, so that a mistake stops with
    one line: an unknown key (``sheme=topk``, ``+train.lr=0.1``: Hydra would add it, and nothing
    reads it) with the closest key, a value of the wrong type, an unknown option of a group
    (``scheme=nope``, ``hydra/launcher=nope``), a scheme's own key with another scheme
    (``scheme=topk scheme.block_size=64``: block_size belongs to scheme=blockk). Sweeps (``a,b``,
    ``range(...)``) are checked value by value; keys under ``hydra.`` and Hydra's other groups are
    left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    items = [a for a in args if "=" in a and not a.startswith("-")]
    if not items:
        return
    dirs = search_dirs(args)  # --config-dir, hydra.searchpath: their options count too
    multirun = "-m" in args or "--multirun" in args
    parser = OverridesParser.create()
    keys = schema_keys()
    owners = scheme_options()
    schemas: dict[type, Any] = {}
    parsed = []
    for item in items:
        try:
            (override,) = parser.parse_overrides([item])
        except HydraException as exc:
            raise ConfigError(f"{item} cannot be read: {str(exc).splitlines()[0]}") from None
        parsed.append((item, override))
    own = []  # (item, key) of the schemes' own keys: checked against the schemes the line runs
    options = []  # (item, key) of the compressor's options: checked against its class's arguments
    for item, override in parsed:
        key, text = override.key_or_group, item.partition("=")[2]
        if override.package is not None or key == "hydra" or key.startswith(("hydra.", "hydra/")):
            if key == "hydra/launcher" and not override.is_sweep_override():
                allowed = launcher_options(dirs)
                if text not in allowed:
                    raise ConfigError(f"hydra/launcher={text!r} is not allowed; choose one of: {', '.join(allowed)}")
            continue
        if key.count(".") == 1 and key.startswith("scheme.") and not _known(key, keys):
            _compressor_hint(item, key, text, _chosen_compressors(parsed, multirun, dirs))
        node = key.split(".")[1] if key.count(".") >= 2 and key.startswith("scheme.") else None
        if node in CLASS_NODES and key.split(".")[2] not in ("_target_", "_partial_"):
            options.append((item, key))
        if not _known(key, keys):
            hint = did_you_mean(key, [*keys, *GROUPS])
            hint = f"did you mean {hint}={text}? " if hint else ""
            raise ConfigError(f"{item}: there is no key {key!r}; {hint}`python -m sparsetrain.run --help` lists every key")
        if override.is_add() and key in keys:
            raise ConfigError(f"{item}: {key} exists already; drop the '+' ({key}={text})")
        if key in owners:
            own.append((item, key))
        if override.is_delete() or override.value_type in (ValueType.INTERVAL_SWEEP, ValueType.GLOB_CHOICE_SWEEP):
            continue
        if override.is_sweep_override():
            values = list(override.sweep_iterator())
        else:
            values = [override.value()]
        if key in GROUPS:
            allowed = group_options(key, dirs)
            for choice in values:
                if str(choice) not in allowed and not (key in ("experiment", "point", "debug") and choice is None):
                    raise ConfigError(f"{key}={choice!r} is not allowed; choose one of: {', '.join(allowed)}")
            continue
        scheme_cls = SCHEME_SCHEMAS[owners[key][0]] if key in owners else SchemeConfig
        if scheme_cls not in schemas:
            schemas[scheme_cls] = _typed_schema(scheme_cls)
        for value in values:
            if isinstance(value, str) and "${" in value:  # an interpolation: resolved later
                continue
            default = OmegaConf.select(schemas[scheme_cls], key, default=None)
            try:
                OmegaConf.update(schemas[scheme_cls], key, value, merge=True)
            except OmegaConfBaseException as exc:
                reason = _wanted(key, str(exc).splitlines()[0], value, default)
                raise ConfigError(f"{key}={value!r} is not allowed: {reason}") from None
    # scheme.compressor.<option> (memory, sync): an argument of the class each chosen scheme's node names
    for item, key in options:
        _, node, option = key.split(".")[:3]
        for scheme, target in _chosen_compressors(parsed, multirun, dirs, node):
            if target is None:
                raise ConfigError(f"{item}: scheme={scheme} has no {node} (scheme.{node} is null{_NULL_NODE[node]})")
            check_compressor_option(option, target, item, node)
    if own:  # a scheme's own key (scheme.block_size) goes with that scheme only
        chosen = _chosen_schemes([o for _, o in parsed], multirun, dirs)
        for item, key in own:
            for scheme in chosen:
                if scheme not in owners[key]:
                    leaf = key.rpartition(".")[2]
                    belongs = " or ".join(f"scheme={name}" for name in owners[key])
                    raise ConfigError(f"{item}: scheme={scheme} has no key {leaf!r}; {leaf} belongs to {belongs}")


def _chosen_compressors(parsed: list, multirun: bool, dirs: tuple[Path, ...],
                        node: str = "compressor") -> list[tuple[str, str | None]]:
    """``(scheme, <node>._target_)`` for each scheme the command line runs (``node``: compressor,
    memory or sync): the target that ``scheme.<node>._target_=`` sets, else the one its yaml
    (conf/ or an extra folder) names."""
    target = next((str(o.value()) for _, o in parsed if o.key_or_group == f"scheme.{node}._target_"
                   and not o.is_delete() and not o.is_sweep_override()), None)
    return [(scheme, target or scheme_target(scheme, dirs, node))
            for scheme in _chosen_schemes([o for _, o in parsed], multirun, dirs)]


def scheme_target(scheme: str, dirs: tuple[Path, ...] = (), node: str = "compressor") -> str | None:
    """The ``<node>._target_`` (compressor, memory or sync) of conf/scheme/<scheme>.yaml (the
    first folder that has it, as Hydra searches them); None for a scheme without that node."""
    for conf in (CONF_DIR, *dirs):
        path = conf / "scheme" / f"{scheme}.yaml"
        if path.is_file():
            target = OmegaConf.select(OmegaConf.load(path), f"{node}._target_", default=None)
            return None if target is None else str(target)
    return None


def compressor_class(target: str, node: str = "compressor") -> type:
    """The class ``scheme.<node>._target_`` names; ``ConfigError`` (one line) when its module
    cannot be imported (the usual cause: a researcher's module not on PYTHONPATH)."""
    import importlib

    module, _, name = target.rpartition(".")
    try:
        found = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001  (whatever the module raises on import)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"cannot import {module or target} for scheme.{node}._target_={target}: "
                          f"{reason}; is its folder on PYTHONPATH?") from None
    if not isinstance(getattr(found, name, None), type):
        raise ConfigError(f"scheme.{node}._target_={target} is not allowed: {module} has no class {name!r}")
    return getattr(found, name)


#: The scheme's nodes that name a class and take its options (``scheme.<node>.<option>``): the
#: base class whose ``__init__`` ends the search for options, and what the harness passes
#: itself, which is no option (comm.build: a compressor's ratio, layout, scope, device; a
#: memory's numel, enabled, device, dtype; train.components: a sync's params, buffers, inner
#: reducer, warmup_steps, gradients).
CLASS_NODES = {
    "compressor": ("sparsetrain.compress.base.Compressor", ("ratio", "layout", "scope", "device")),
    "memory": ("sparsetrain.compress.feedback.Memory", ("numel", "enabled", "device", "dtype")),
    "sync": ("sparsetrain.comm.periodic.PeriodicSync",
             ("params", "buffers", "inner", "warmup_steps", "group", "gradients")),
}
# What a null node means, said where an option is given to one.
_NULL_NODE = {
    "compressor": "",
    "memory": ": error feedback, which takes no options; a memory of one's own is named in the scheme's "
              "yaml, docs/own_compressor.md",
    "sync": ": every step's exchange; periodic synchronisation is scheme=localsgd or scheme=diloco",
}


def compressor_arguments(cls: type, node: str = "compressor") -> list[str] | None:
    """The options ``cls`` takes (``scheme.<node>.<option>``): the keyword arguments of its
    ``__init__`` and, through ``**kw``, of its bases' up to the node's base (``Compressor``,
    ``Memory``, ``PeriodicSync``), less what the harness passes itself. None when a ``**kw``
    goes where it cannot be read (any option may then be right)."""
    import importlib
    import inspect

    where, built_with = CLASS_NODES[node]
    module, _, name = where.rpartition(".")
    base = getattr(importlib.import_module(module), name)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    out: list[str] = []
    for klass in cls.__mro__:
        if klass is object:
            return None
        if "__init__" not in vars(klass):
            continue
        params = list(inspect.signature(klass.__init__).parameters.values())
        out += [p.name for p in params if p.kind in named and p.name not in ("self", *built_with, *out)]
        if klass is base or not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return out
    return None


def check_compressor_option(option: str, target: str, item: str, node: str = "compressor") -> None:
    """``item`` (``scheme.<node>.<option>=...``) names an argument the class takes, else
    ``ConfigError`` naming the key, the class and the arguments it does take."""
    accepted = compressor_arguments(compressor_class(target, node), node)
    if accepted is not None and option not in accepted:
        raise ConfigError(f"{item}: {target} takes no argument {option!r}; it takes "
                          f"{', '.join(accepted) or 'no options'} (scheme.{node}.<option>=...)")


def _compressor_hint(item: str, key: str, text: str, chosen: list[tuple[str, str | None]]) -> None:
    """An unknown ``scheme.<leaf>`` with a scheme whose class takes ``leaf``: its options go under
    ``scheme.compressor.``; with one whose class does not, what the class takes (another scheme's
    key, ``scheme.rank``, is no hint). Returns when no chosen scheme has a class to ask."""
    leaf = key.partition(".")[2]
    for scheme, target in chosen:
        if target is None:
            continue
        try:
            accepted = compressor_arguments(compressor_class(target))
        except ConfigError:
            continue  # validate() reports it when it builds the compressor
        if accepted is None:
            continue
        if leaf in accepted:
            raise ConfigError(f"{item}: there is no key {key!r}; compressor options go under "
                              f"scheme.compressor.<option>: scheme.compressor.{leaf}={text}")
        own = [f.name for f in dataclasses.fields(SCHEME_SCHEMAS.get(scheme, SchemeConfig))]
        close = difflib.get_close_matches(leaf, own, n=1, cutoff=0.75)
        hint = f"did you mean scheme.{close[0]}={text}? " if close else ""
        raise ConfigError(f"{item}: there is no key {key!r}; {hint}scheme={scheme}'s compressor {target} takes "
                          f"{', '.join(accepted) or 'no options'} (scheme.compressor.<option>=...)")


# The range validate() checks, said already where a value is not a number at all (ratio=1%).
_NUMBER_RANGES = {"ratio": "in (0, 1]", "world_size": ">= 1"}


def _wanted(key: str, reason: str, value: Any, default: Any) -> str:
    """What a number key takes, with an example, for a value that is not one (``ratio=1%``:
    ``give a number in (0, 1], e.g. ratio=0.01``) instead of OmegaConf's conversion text; any
    other type error keeps OmegaConf's first line."""
    kind = reason.rpartition(" converted to ")[2]
    if kind not in ("Float", "Integer"):
        return reason
    what = ("a number" if kind == "Float" else "an integer") + (f" {_NUMBER_RANGES[key]}" if key in _NUMBER_RANGES else "")
    text = str(value).strip()
    example = default if isinstance(default, (int, float)) and not isinstance(default, bool) else None
    if kind == "Float" and text.endswith("%"):  # a percentage: the fraction it means
        try:
            example = float(text[:-1]) / 100
        except ValueError:
            pass
    return f"give {what}" + (f", e.g. {key}={example:g}" if example is not None else "")

