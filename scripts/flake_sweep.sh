#!/usr/bin/env bash
# The flake sweep (docs/ci.md): the whole Release suite ROUNDS times in a row (default 3)
# while stress-ng keeps every core busy, with no retry: a test that fails once fails the
# sweep. Builds the Release tree first if needed (as scripts/ci.py does). Prints each
# round's result and the failed tests, and exits non-zero if any round failed.
#   bash scripts/flake_sweep.sh [ROUNDS] [ctest arguments...]   e.g. bash scripts/flake_sweep.sh 3 -R Engine
# Environment: JOBS (ctest parallelism, default 2), STRESS_WORKERS (stress-ng CPU workers,
# default: one per core).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
JOBS=${JOBS:-2}
workers=${STRESS_WORKERS:-$(nproc)}
command -v stress-ng > /dev/null || { echo "flake_sweep: needs stress-ng (scripts/install_deps.sh)" >&2; exit 2; }
source scripts/ccache_env.sh
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCOLLSERVE_BUILD_TESTS=ON -DCOLLSERVE_BUILD_BENCH=ON > /dev/null
fi
cmake --build build -j "$JOBS" > /dev/null
logs=build/flake-sweep
mkdir -p "$logs"
# stress-ng: $workers CPU hogs at normal priority for as long as the sweep runs (bounded at
# 3 hours), stopped on exit.
stress-ng --cpu "$workers" --cpu-method matrixprod --timeout 3h --quiet &
stress=$!
trap 'kill $stress 2> /dev/null || true; wait $stress 2> /dev/null || true' EXIT
failed=0
for ((round = 1; round <= rounds; round++)); do
  start=$(date +%s)
  rc=0
  ctest --test-dir build -j "$JOBS" --timeout 300 --output-on-failure "$@" > "$logs/round$round.log" 2>&1 || rc=$?
  summary=$(grep -E 'tests passed|tests failed out of' "$logs/round$round.log" | tail -1)
  echo "flake_sweep: round $round: ${summary:-no summary} ($(($(date +%s) - start)) s, exit $rc)"
  if [ $rc -ne 0 ]; then
    failed=1
    sed -n '/The following tests FAILED/,$p' "$logs/round$round.log"
  fi
done
[ $failed -eq 0 ] && echo "flake_sweep: $rounds rounds passed under stress-ng ($workers CPU workers)"
exit $failed
