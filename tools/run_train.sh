#!/usr/bin/env bash
# Launch `titan train` under torchrun: one process per device on this node, any number of
# nodes through torchrun's c10d rendezvous. Every argument is passed through to titan train,
# except torchrun's --max-restarts N: when a rank dies (a crash, a SIGKILL, a lost node), torchrun
# stops the others and starts the job again, up to N times; each restart resumes from the last
# complete checkpoint (--checkpoint.enable), never from a half-written one.
#
#   ./tools/run_train.sh --config llama3_debug --training.steps 50
#   NGPU=8 ./tools/run_train.sh --max-restarts 3 --config llama3_8b --checkpoint.enable
#   NGPU=4 ./tools/run_train.sh --config llama3_debug --parallelism.tensor_parallel_degree 2
#   NNODES=2 RDZV_ENDPOINT=host0:29500 NGPU=8 ./tools/run_train.sh --config llama3_8b   # on each node
#
# Environment:
#   NGPU / NPROC     processes on this node (default 1; NPROC is an alias for CPU runs)
#   NNODES           number of nodes (default 1)
#   RDZV_ENDPOINT    host:port of the c10d rendezvous (default localhost:0 = a free port, 1 node)
#   RDZV_ID          rendezvous id shared by all nodes of one job (default titan)
#   LOG_RANK         ranks whose output is shown, comma separated (default 0)
#   MAX_RESTARTS     the default of --max-restarts (default 0: a failed rank ends the job)
#   CONFIG_FILE      a torchtitan-style TOML job file, passed as --job.config_file (as torchtitan's
#                    run_train.sh does); flags on the command line override it
#   PYTHON           interpreter (default .venv/bin/python when present, else python3)
#   COMM_MODE        fake_backend: dry run instead of training. No torchrun: one process
#                    validates the config for NGPU x NNODES ranks on this CPU (fake process
#                    group, meta device) and prints each pipeline rank's memory estimate:
#                    NGPU=512 COMM_MODE=fake_backend ./tools/run_train.sh --config llama3_405b \
#                        --parallelism.data_parallel_shard_degree 8
#
# Multi-node: run this script once per node with the same NNODES, RDZV_ENDPOINT (a host:port
# on the first node) and RDZV_ID (tools/slurm/titan.sbatch does this). There is no NODE_RANK:
# with c10d rendezvous torchrun assigns node ranks itself (the node whose hostname matches
# the endpoint hosts the store); torchrun's --node_rank only applies to static rendezvous and
# is ignored with a warning otherwise, so a NODE_RANK in the environment is not passed on.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nproc="${NGPU:-${NPROC:-1}}"
nnodes="${NNODES:-1}"
rdzv_endpoint="${RDZV_ENDPOINT:-localhost:0}"
rdzv_id="${RDZV_ID:-titan}"
log_rank="${LOG_RANK:-0}"
# shellcheck source=lib/python.sh
source "$here/tools/lib/python.sh"

# torchrun's own option among the arguments; everything else goes to titan train.
max_restarts="${MAX_RESTARTS:-0}"
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --max-restarts|--max_restarts)
      if [[ $# -lt 2 ]]; then echo "run_train.sh: $1 needs a number" >&2; exit 2; fi
      max_restarts="$2"; shift 2 ;;
    --max-restarts=*|--max_restarts=*) max_restarts="${1#*=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if [[ -n "${CONFIG_FILE:-}" ]]; then
  args=(--job.config_file "$CONFIG_FILE" ${args[@]+"${args[@]}"})
fi
if ! [[ "$max_restarts" =~ ^[0-9]+$ ]]; then
  echo "run_train.sh: --max-restarts must be a non-negative integer, got '$max_restarts'" >&2
  exit 2
fi

if [[ "${COMM_MODE:-}" == "fake_backend" ]]; then
  # The dry run is one process whatever the world size: never start torchrun.
  export WORLD_SIZE=$((nproc * nnodes))
  exec "$python" -m titan.recipes.cli train ${args[@]+"${args[@]}"}
fi

if [[ "$nnodes" -gt 1 && "$rdzv_endpoint" == "localhost:0" ]]; then
  echo "run_train.sh: NNODES=$nnodes needs RDZV_ENDPOINT=host:port reachable from every node" >&2
  exit 2
fi

exec "$python" -m torch.distributed.run \
  --nproc_per_node="$nproc" \
  --nnodes="$nnodes" \
  --rdzv_backend=c10d \
  --rdzv_endpoint="$rdzv_endpoint" \
  --rdzv_id="$rdzv_id" \
  --max-restarts="$max_restarts" \
  --local-ranks-filter="$log_rank" \
  --role=rank \
  --tee=3 \
  -m titan.recipes.cli train ${args[@]+"${args[@]}"}
