#!/bin/bash
# Open MPI: mpirun starts the workers and sets OMPI_COMM_WORLD_*; it knows no coordinator address,
# so pass rank 0's host (the first host of -H) with -x.
set -euo pipefail
HOSTS=${HOSTS:-node1:2,node2:2}
FIRST_HOST=${HOSTS%%:*}
export TFCS_TOKEN=${TFCS_TOKEN:-$(python -c 'import secrets; print(secrets.token_hex(16))')}
mpirun -np 4 -H "$HOSTS" \
  -x TFCS_COORDINATOR="$FIRST_HOST:29500" -x TFCS_TOKEN -x PATH -x PYTHONPATH \
  python examples/keras_mnist.py --epochs 3
