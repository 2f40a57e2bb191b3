#!/usr/bin/env bash
# Repeats the fault scenarios of issue 17 and reports survived / failed / hung per scenario.
# CI runs each scenario once or twice (the ordinary test suite); this runs TRIALS of each
# (default 20).   bash scripts/fault_trials.sh [TRIALS] [SCENARIO...]   (after a build in ./build)
#
# Scenarios:
#   coordinator  kill -9 of the coordinator while 4 ranks on 2 sidecars run all_reduce and
#                store writes in a loop, restart 2 s later (tests/fault/coordinator_restart_test)
#   rank_kill    examples/digits_sgd_elastic.py, 4 ranks; rank 2 SIGKILLs itself mid-epoch 2;
#                the 3 survivors re-form (collserve.reconfigure) and must reach >= 90 %
#   rank_restart the same under `collserve launch --survive_failures --max_restarts 1`: the
#                lost rank is started again, rejoins, and the job must end with 4 ranks at >= 90 %
#   link_cut     3 hosts in network namespaces (root), host 2 is cut off (nft drop) mid-all_reduce;
#                hosts 1 and 3 must re-form without it and go on (multihost_netns_test)
#   link_heal    as link_cut, then the link heals and host 2's ranks must rejoin (6 ranks again)
#   cut_timing   2 hosts (root), host 2 cut off from its peer and the coordinator mid-all_reduce
#                with a 5 s op timeout: every rank on both sides must fail within 6 s of its
#                call (issue 41); the worst time of each trial is printed
#   cut_timing3  the same among 3 hosts (hosts 1 and 3 still reach each other)
# A trial that passes its check survived; one that ends otherwise failed; one that does not
# end within its bound (killed by timeout) hung. Logs: /tmp/collserve-fault-trials/.
set -uo pipefail
cd "$(dirname "$0")/.."
trials="${1:-20}"
shift || true
scenarios=("$@")
[ ${#scenarios[@]} -gt 0 ] || scenarios=(coordinator rank_kill rank_restart link_cut link_heal cut_timing cut_timing3)
build=build
[ -x "$build/server/collserve-sidecar" ] || { echo "build first: $build/server/collserve-sidecar is missing" >&2; exit 2; }
logs=/tmp/collserve-fault-trials
mkdir -p "$logs"
export PYTHONPATH="$PWD/$build/python${PYTHONPATH:+:$PYTHONPATH}"
# The interpreter the build's Python module is for (CMake's Python3_EXECUTABLE).
python=$(sed -n 's/^_*Python3_EXECUTABLE:[A-Z]*=//p' "$build/CMakeCache.txt" | head -1)
python=${python:-python3}
bad=0

# one SCENARIO TRIAL BOUND_S COMMAND...: runs a trial; 0 survived, 124 hung, else failed.
one() {
  local name=$1 t=$2 bound=$3
  shift 3
  timeout -k 10 "$bound" "$@" > "$logs/$name-$t.log" 2>&1
}

for s in "${scenarios[@]}"; do
  survived=0 failed=0 hung=0
  for t in $(seq 1 "$trials"); do
    case $s in
      coordinator)
        COLLSERVE_FAULT_TRIALS=1 one "$s" "$t" 120 "$build/tests/fault/coordinator_restart_test" \
          --gtest_filter=CoordinatorRestartTest.RunningJobSurvivesKillAndRestart ;;
      rank_kill)
        one "$s" "$t" 300 "$python" -m collserve.launch --nproc_per_node 4 --survive_failures \
          examples/digits_sgd_elastic.py --epochs 10 --die_rank 2 --die_epoch 2 --min_accuracy 0.9 &&
          [ "$(grep -c 'of 3, test accuracy' "$logs/$s-$t.log")" = 3 ] ;;
      rank_restart)
        one "$s" "$t" 300 "$python" -m collserve.launch --nproc_per_node 4 --survive_failures --max_restarts 1 \
          examples/digits_sgd_elastic.py --epochs 10 --die_rank 2 --die_epoch 2 --min_accuracy 0.9 &&
          [ "$(grep -c 'of 4, test accuracy' "$logs/$s-$t.log")" = 4 ] ;;
      link_cut)
        one "$s" "$t" 200 "$build/tests/fault/multihost_netns_test" \
          --gtest_filter=NetnsHosts.CutHostIsLeftBehindAndTheOthersReformWithoutIt &&
          ! grep -q "SKIPPED" "$logs/$s-$t.log" ;;
      link_heal)
        one "$s" "$t" 200 "$build/tests/fault/multihost_netns_test" \
          --gtest_filter=NetnsHosts.CutHostRejoinsAtTheNextGenerationOnceTheLinkHeals &&
          ! grep -q "SKIPPED" "$logs/$s-$t.log" ;;
      cut_timing|cut_timing3)
        filter=NetnsHosts.EverySideOfACutFailsWithinTheOpTimeoutPlusOneSecond
        [ "$s" = cut_timing3 ] && filter=NetnsHosts.EverySideOfACutAmongThreeHostsFailsWithinTheOpTimeoutPlusOneSecond
        one "$s" "$t" 120 "$build/tests/fault/multihost_netns_test" --gtest_filter="$filter" &&
          ! grep -q "SKIPPED" "$logs/$s-$t.log"
        rc=$?
        grep -h "each rank's error" "$logs/$s-$t.log" | sed "s/^/  trial $t: /"
        (exit $rc) ;;
      *) echo "unknown scenario $s" >&2; exit 2 ;;
    esac
    rc=$?
    if [ $rc -eq 0 ]; then
      survived=$((survived + 1))
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
      hung=$((hung + 1))
    else
      failed=$((failed + 1))
    fi
  done
  echo "$s: $trials trials, $survived survived, $failed failed, $hung hung"
  [ $survived -eq "$trials" ] || bad=1
done
exit $bad
