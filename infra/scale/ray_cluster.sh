#!/usr/bin/env bash
# A Ray cluster for rlpipe on GPU nodes, then the run (docs/operations.md, "Scale out"). Every node needs this
# repository and its .venv at the same path, and storage_root on a shared filesystem.
#   on the head:        infra/scale/ray_cluster.sh head
#   on each other node: infra/scale/ray_cluster.sh worker HEAD_ADDRESS
#   then, on the head:  rlpipe run CONFIG --set engines.ray_address=auto  (infra/scale/two_nodes.yaml), or
#   from anywhere:      ray job submit --address http://HEAD_ADDRESS:8265 -- rlpipe run CONFIG --set engines.ray_address=auto
set -euo pipefail
cd "$(dirname "$0")/../.."
source .venv/bin/activate
case "${1:-}" in
  head) ray start --head --port=6379 --dashboard-host=0.0.0.0 --num-gpus="$(nvidia-smi -L | wc -l)" ;;
  worker) ray start --address="${2:?the head's address}:6379" --num-gpus="$(nvidia-smi -L | wc -l)" ;;
  *) echo "usage: $0 head | worker HEAD_ADDRESS" >&2; exit 2 ;;
esac
