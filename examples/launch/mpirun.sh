#!/bin/bash
# Open MPI: mpirun starts the workers and sets OMPI_COMM_WORLD_*; it knows no coordinator address,
# so pass rank 0's host (the first host of -H) with -x. Arguments after the script's name go to the
# training script:   HOSTS=node1:2,node2:2 NP=4 bash examples/launch/mpirun.sh --epochs 3
set -euo pipefail
HOSTS=${HOSTS:-node1:2,node2:2}
NP=${NP:-4}
PORT=${PORT:-29500}
FIRST_HOST=${HOSTS%%:*}
export TFCS_TOKEN=${TFCS_TOKEN:-$(python -c 'import secrets; print(secrets.token_hex(16))')}
mpirun -np "$NP" -H "$HOSTS" \
  -x TFCS_COORDINATOR="$FIRST_HOST:$PORT" -x TFCS_TOKEN -x PATH ${PYTHONPATH:+-x PYTHONPATH} \
  python examples/keras_mnist.py "$@"
