"""Old import path: ranks and launchers are ``sparsetrain.launch``'s, the process group
``sparsetrain.comm.group``'s. Kept for existing scripts."""

from sparsetrain.comm.group import (  # noqa: F401
    RankInfo,
    destroy_process_group,
    init_process_group,
    pick_device,
    resolve_backend,
)
from sparsetrain.launch.env import check_launch_environment, launcher_of, rank_info  # noqa: F401
from sparsetrain.launch.spawn import PEER_LOST, free_port, peer_lost, spawn_ranks  # noqa: F401
