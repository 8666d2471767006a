"""Config schemas (Hydra ConfigStore) and the semantic checks that run before any rank starts.

One module per job, every name importable from ``sparsetrain.config`` as before:

- ``schema``: the dataclasses that type every key, ``register()``, ``schema_keys``. A scheme's
  keys are its structured config's: ``SchemeConfig`` (the keys every scheme has) or, for a scheme
  with options of its own, its subclass in ``SCHEME_SCHEMAS`` (``BlockKConfig``: ``block_size``;
  ``PowerSGDConfig``: ``rank``), which conf/scheme/<name>.yaml names in its defaults list
  (``base_scheme``, ``base_<name>``).
- ``overrides``: ``check_overrides`` reads the command line before Hydra does: an unknown key
  (with or without ``+``), a value of the wrong type, an unknown group option or a scheme's own
  key with another scheme stops with one line (and a "did you mean").
- ``help``: ``HELP`` says what each key does, ``GROUP_HELP`` each group (``--help`` prints them).
- ``validation``: ``validate`` checks what types cannot express (ranges, combinations, the launch
  environment); ``compose``; the tuned values experiment=protocol reads.

Both checks raise ``ConfigError`` with one line naming the key, the value and what is allowed.
"""

from sparsetrain.config.help import GROUP_HELP, HELP, help_text
from sparsetrain.config.overrides import (
    CLASS_NODES,
    FREE_FORM,
    check_compressor_option,
    check_overrides,
    compressor_arguments,
    compressor_class,
    did_you_mean,
    group_options,
    launcher_options,
    scheme_target,
    search_dirs,
)
from sparsetrain.config.schema import (
    CONF_DIR,
    GROUPS,
    SCHEME_SCHEMAS,
    TUNED_DIR,
    BlockKConfig,
    Config,
    DataConfig,
    DistConfig,
    ModelConfig,
    NamedConfig,
    OptimConfig,
    PowerSGDConfig,
    QSGDConfig,
    SchemeConfig,
    TrainConfig,
    WandbConfig,
    _nodes,  # noqa: F401  (tests read the resolvers)
    _tasks_per_node,  # noqa: F401
    register,
    schema_keys,
    scheme_options,
    tuned_value,
)
from sparsetrain.config.validation import (
    compose,
    scheme_compressor,
    scheme_memory,
    scheme_sync,
    validate,
)
from sparsetrain.errors import ConfigError

__all__ = [
    "CLASS_NODES", "CONF_DIR", "FREE_FORM", "GROUPS", "GROUP_HELP", "HELP", "SCHEME_SCHEMAS", "TUNED_DIR", "BlockKConfig",
    "Config", "ConfigError", "DataConfig", "DistConfig", "ModelConfig", "NamedConfig", "OptimConfig",
    "PowerSGDConfig", "QSGDConfig", "SchemeConfig", "TrainConfig", "WandbConfig", "check_compressor_option",
    "check_overrides", "compose", "compressor_arguments", "compressor_class", "did_you_mean", "group_options",
    "help_text", "launcher_options", "register", "schema_keys", "scheme_compressor", "scheme_memory", "scheme_options", "scheme_sync",
    "scheme_target", "search_dirs", "tuned_value", "validate",
]
