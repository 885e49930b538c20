#!/usr/bin/env bash
# A fault-tolerant job on one machine: torchft's lighthouse and REPLICAS replica groups, each
# an ordinary `titan train` job of NGPU ranks under tools/run_train.sh (so a group whose rank
# dies is restarted by torchrun, up to --max-restarts times, and rejoins the live groups by
# fetching their state). Every argument goes to each group's titan train, which gets
# --fault_tolerance.enable, its replica id and --job.dump_folder DUMP/replica_<i>.
#
#   REPLICAS=2 ./tools/run_ft.sh --config llama3_debug --training.steps 200
#   REPLICAS=2 NGPU=4 ./tools/run_ft.sh --max-restarts 3 --config llama3_8b --checkpoint.enable
#
# Environment:
#   REPLICAS        replica groups (default 2)
#   MIN_REPLICAS    groups a step needs (lighthouse --min_replicas and
#                   --fault_tolerance.min_replica_size; default 1)
#   DUMP            the job's folder; group i writes to DUMP/replica_<i> (default ./outputs/ft)
#   NGPU, PYTHON, MAX_RESTARTS: as for tools/run_train.sh
# Across machines: run torchft_lighthouse once, export TORCHFT_LIGHTHOUSE=http://host:port and
# start each group with tools/run_train.sh --fault_tolerance.enable --fault_tolerance.replica_id I
# --fault_tolerance.group_size N (tools/slurm shows the multi-node launch of one group).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
replicas="${REPLICAS:-2}"
min_replicas="${MIN_REPLICAS:-1}"
dump="${DUMP:-./outputs/ft}"
# shellcheck source=lib/python.sh
source "$here/tools/lib/python.sh"
lighthouse_bin="$(dirname "$python")/torchft_lighthouse"
if [[ ! -x "$lighthouse_bin" ]]; then
  echo "run_ft.sh: torchft_lighthouse not found next to $python: pip install 'titan-train[ft]'" >&2
  exit 2
fi
if ! [[ "$replicas" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_ft.sh: REPLICAS must be a positive integer, got '$replicas'" >&2
  exit 2
fi

mkdir -p "$dump"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT INT TERM

# The lighthouse on a free port; its address is read from its first log line.
"$lighthouse_bin" --min_replicas "$min_replicas" --join_timeout_ms 5000 --bind "[::]:0" \
  > "$dump/lighthouse.log" 2>&1 &
pids+=("$!")
port=""
for _ in $(seq 1 200); do
  port="$(grep -o 'listening on: http://[^ ]*' "$dump/lighthouse.log" | grep -o '[0-9]*$' || true)"
  [[ -n "$port" ]] && break
  sleep 0.05
done
if [[ -z "$port" ]]; then
  echo "run_ft.sh: the lighthouse did not start; see $dump/lighthouse.log" >&2
  exit 1
fi
export TORCHFT_LIGHTHOUSE="http://localhost:$port"
echo "run_ft.sh: lighthouse at $TORCHFT_LIGHTHOUSE, $replicas replica groups under $dump" >&2

groups=()
for ((i = 0; i < replicas; i++)); do
  PYTHON="$python" "$here/tools/run_train.sh" "$@" \
    --fault_tolerance.enable --fault_tolerance.group_size "$replicas" --fault_tolerance.replica_id "$i" \
    --fault_tolerance.min_replica_size "$min_replicas" --job.dump_folder "$dump/replica_$i" \
    > "$dump/replica_$i.log" 2>&1 &
  groups+=("$!")
  pids+=("$!")
done

# The job succeeds when every group finishes; a group that failed past its restarts is reported.
status=0
for ((i = 0; i < replicas; i++)); do
  if ! wait "${groups[$i]}"; then
    echo "run_ft.sh: replica group $i failed; see $dump/replica_$i.log" >&2
    status=1
  fi
done
exit "$status"
