#!/usr/bin/env bash
# Same as scripts/netns_cluster.py (the implementation); kept so both names work.
exec python3 "$(dirname "$(readlink -f "$0")")/netns_cluster.py" "$@"
