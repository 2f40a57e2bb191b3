#!/usr/bin/env bash
# A/B of a one-host heap broadcast or all_reduce (4 ranks) with and without peer reads,
# against torch's Gloo in the same rounds (bench/RESULTS.md, "peer reads"). Prints busbw
# (GB/s) per size and round. Needs a build in build/ and torch.
#   bash bench/peer_reads_ab.sh [ROUNDS] [OP] [B] [FLAGS]
# OP: broadcast (default), all_reduce, all_gather or reduce_scatter. B: the environment of
# the B runs (default COLLSERVE_PEER_READS=0; COLLSERVE_SEGMENT_RELEASE=0 compares segment
# release; COLLSERVE_OPS_CHANNEL=0 the ops channel). Every side reports the same column:
# in-place for the ops bench/torch_perf.py runs in place (all_reduce, broadcast), else
# out-of-place (torch_perf prints N/A in its in-place columns for those), as compare.py.
# FLAGS: more flags for both benchmark programs, e.g. "-z 1" (each op waited for before the
# next: latency, as a program that calls broadcast without async_op sees it).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
op="${2:-broadcast}"
b_env="${3:-COLLSERVE_PEER_READS=0}"
read -r -a flags <<< "${4:-}"
launch=(env PYTHONPATH=build/python /usr/bin/python3 -m collserve.launch --nproc_per_node 4 --no_prefix)
# busbw is the 8th field of a row (out-of-place) or the 12th (in-place).
field=12
case "$op" in all_reduce | broadcast) ;; *) field=8 ;; esac
busbw() { grep -E "^ +[0-9]+ " | awk -v f="$field" '{print $f}' | head -1; }
for round in $(seq 1 "$rounds"); do
  for size in 1M 64M; do
    n=30
    [ "$size" = 64M ] && n=10
    gloo=$(timeout 300 "${launch[@]}" bench/torch_perf.py --backend gloo -o "$op" -b "$size" -e "$size" -n "$n" -w "$n" "${flags[@]}" 2>&1 | busbw)
    peer=$(timeout 300 "${launch[@]}" --no_python build/bench/collserve-perf -o "$op" -b "$size" -e "$size" -m heap -n "$n" -w "$n" "${flags[@]}" 2>&1 | busbw)
    staged=$(env "$b_env" timeout 300 "${launch[@]}" --no_python build/bench/collserve-perf -o "$op" -b "$size" -e "$size" -m heap -n "$n" -w "$n" "${flags[@]}" 2>&1 | busbw)
    echo "$op round $round size $size: torch gloo $gloo | A (defaults) $peer | B ($b_env) $staged"
  done
done
