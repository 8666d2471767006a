"""Old import path of ``sparsetrain.comm`` (the exchange moved there); kept for existing scripts."""

from sparsetrain.comm import *  # noqa: F403  (the same names, one list: sparsetrain.comm.__all__)
from sparsetrain.comm import __all__ as _comm_names
from sparsetrain.compress import available  # noqa: F401  (exported here before the move)

__all__ = [*_comm_names, "available"]
