#!/usr/bin/env bash
# Same as `python -m sparsetrain.launch.netcluster` (scripts/netns_cluster.py); kept so both names work.
exec python3 "$(dirname "$(readlink -f "$0")")/netns_cluster.py" "$@"
