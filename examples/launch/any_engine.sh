#!/bin/bash
# Any other engine: give every worker these four variables (and one shared token), then run the script.
#   TFCS_RANK         this worker's rank, 0..N-1
#   TFCS_WORLD_SIZE   N
#   TFCS_LOCAL_RANK   index among the workers on this host (optional: derived from hostnames)
#   TFCS_COORDINATOR  host:port of rank 0 (rank 0 listens there)
set -euo pipefail
export TFCS_RANK=${TFCS_RANK:?set TFCS_RANK} TFCS_WORLD_SIZE=${TFCS_WORLD_SIZE:?set TFCS_WORLD_SIZE}
export TFCS_COORDINATOR=${TFCS_COORDINATOR:?set TFCS_COORDINATOR to rank 0\'s host:port}
exec python examples/keras_mnist.py "$@"
