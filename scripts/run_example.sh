#!/usr/bin/env bash
# Runs the C++ all_reduce example end to end on the embedded default: a coordinator and
# two sidecars on loopback, four ranks (two per sidecar, i.e. two simulated hosts), each
# printing its all_reduce result. Everything started here is stopped on exit.
# Usage: scripts/run_example.sh [build-dir]
set -euo pipefail
build=${1:-build}
bin=$build/server
work=$(mktemp -d /tmp/collserve-example.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

# The coordinator requires a job token (docs/security.md); the ranks present it.
mkdir -m 700 "$work/job-tokens"
token=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
(umask 077 && echo "$token" > "$work/job-tokens/default")
"$bin/collserve-coordinator" --listen_address=127.0.0.1:0 --port_file="$work/coord.port" \
  --metrics_address= --log_level=warning --job_tokens_dir="$work/job-tokens" &
pids+=($!)
for _ in $(seq 100); do [ -s "$work/coord.port" ] && break; sleep 0.1; done
port=$(cat "$work/coord.port")
echo "coordinator on 127.0.0.1:$port"

for h in a b; do
  "$bin/collserve-sidecar" --coordinator="127.0.0.1:$port" --unix_socket="$work/$h.sock" \
    --host_id="host-$h" --metrics_address= --log_level=warning &
  pids+=($!)
done
for h in a b; do
  for _ in $(seq 100); do [ -S "$work/$h.sock" ] && break; sleep 0.1; done
  echo "sidecar host-$h on unix:$work/$h.sock"
done

ranks=()
for rank in 0 1 2 3; do
  h=$([ $rank -lt 2 ] && echo a || echo b)
  RANK=$rank WORLD_SIZE=4 LOCAL_RANK=$((rank % 2)) MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    COLLSERVE_SIDECAR="unix:$work/$h.sock" COLLSERVE_INIT_TIMEOUT_S=60 COLLSERVE_OP_TIMEOUT_S=60 COLLSERVE_TOKEN="$token" \
    timeout 120 "$build/examples/allreduce_example" &
  ranks+=($!)
done
rc=0
for p in "${ranks[@]}"; do wait "$p" || rc=1; done
if [ $rc -eq 0 ]; then
  echo "ok: every rank checked its result (SUM = [10, 20, 30, 40], MAX of ranks = 3)"
else
  echo "a rank failed (see above)" >&2
fi
exit $rc
