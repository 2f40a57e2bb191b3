#!/usr/bin/env bash
# Repeats the fault scenarios of issue 17 and reports survived / failed / hung per scenario.
# CI runs each scenario a few times (the ordinary test suite); this runs TRIALS (default 20).
#   bash scripts/fault_trials.sh [TRIALS]        (after a build in ./build)
# Scenario "coordinator restart": kill -9 of the coordinator while 4 ranks on 2 sidecars run
# all_reduce and store writes in a loop, restart 2 s later (tests/fault/coordinator_restart_test).
set -euo pipefail
cd "$(dirname "$0")/.."
trials="${1:-20}"
bin=build/tests/fault/coordinator_restart_test
[ -x "$bin" ] || { echo "build first: $bin is missing" >&2; exit 2; }
status=0
# Each trial takes about 7 s; 90 s per trial bounds a hang.
COLLSERVE_FAULT_TRIALS="$trials" timeout $(( trials * 90 + 60 )) "$bin" \
  --gtest_filter=CoordinatorRestartTest.RunningJobSurvivesKillAndRestart > /tmp/collserve-fault-trials.log 2>&1 || status=$?
grep "coordinator restart:" /tmp/collserve-fault-trials.log || echo "coordinator restart: no summary (exit $status); see /tmp/collserve-fault-trials.log"
exit "$status"
