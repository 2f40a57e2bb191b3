#!/usr/bin/env bash
# Runs each libFuzzer target (tests/fuzz) for SECONDS seconds (default 60) from a copy of its
# seed corpus, JOBS targets at a time (libFuzzer runs on one core). The targets are the
# fuzz_<name> binaries of the ASan tree (CMake preset asan: clang, ASan+UBSan, everything
# compiled for coverage), which scripts/sanitizers.sh builds and tests too; this script
# configures and builds only them when the tree has not been built. Prints, per target, the
# executions run and the crashes found; exits non-zero if any target crashed, leaked or timed
# out. A crashing input is kept under build-asan/fuzz/artifacts/<target>/: copy it to
# tests/fuzz/regressions/<target>/ so the ordinary suite replays it (fuzz_replay_<target>).
#   bash scripts/fuzz.sh [SECONDS] [TARGET...]     e.g. bash scripts/fuzz.sh 3600 wal_replay
# Environment: JOBS (targets run at once and build parallelism, default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ccache_env.sh
seconds="${1:-60}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(tcpstore_protocol wal_replay collective_request coordinator_rpc sidecar_session ops_channel)
JOBS=${JOBS:-2}
BUILD=build-asan
start=$(date +%s)
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  cmake --preset asan > /tmp/collserve-fuzz-configure.log 2>&1 || { cat /tmp/collserve-fuzz-configure.log; exit 1; }
fi
ccache_stats_log "$BUILD/fuzz"
cmake --build "$BUILD" -j "$JOBS" --target fuzz_targets > "$BUILD/fuzz/build.log" 2>&1 ||
  { tail -n 60 "$BUILD/fuzz/build.log"; echo "fuzz: the targets did not build" >&2; exit 1; }
echo "fuzz: built in $(( $(date +%s) - start )) s ($(ccache_hit_rate "$BUILD/fuzz"))"
# The tree links clang's shared ASan runtime (CMakeLists.txt: the Python suites preload it);
# -fsanitize=fuzzer puts libstdc++ ahead of it in a fuzz binary's libraries, so it is
# preloaded here to come first, as ASan requires.
export LD_PRELOAD="$(clang -print-file-name=libclang_rt.asan-x86_64.so)${LD_PRELOAD:+ $LD_PRELOAD}"
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

# run_target NAME: fuzzes one target; writes its exit code to build-asan/fuzz/NAME.rc.
run_target() {
  local t=$1 work="$BUILD/fuzz/work/$1" artifacts="$BUILD/fuzz/artifacts/$1" log="$BUILD/fuzz/$1.log" rc=0
  rm -rf "$work" "$artifacts"
  mkdir -p "$work" "$artifacts"
  cp -r "tests/fuzz/corpus/$t/." "$work/"
  [ -d "tests/fuzz/regressions/$t" ] && cp -r "tests/fuzz/regressions/$t/." "$work/"
  local extra=()
  # These targets run a server on threads of its own: what they hold between inputs is not
  # a leak of the input.
  case $t in coordinator_rpc | sidecar_session | ops_channel) extra=(-detect_leaks=0) ;; esac
  "$BUILD/tests/fuzz/fuzz_$t" "$work" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=3072 \
    -max_len=65536 -print_final_stats=1 -artifact_prefix="$artifacts/" "${extra[@]}" > "$log" 2>&1 || rc=$?
  echo "$rc" > "$BUILD/fuzz/$t.rc"
}

running=0
for t in "${targets[@]}"; do
  if [ $running -ge "$JOBS" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  run_target "$t" &
  running=$((running + 1))
done
wait || true
# The summary's tools (tail, grep, find) run without the ASan runtime: preloaded into them
# with detect_leaks=1 it aborted tail at exit, and a failed target's log went unshown.
unset LD_PRELOAD ASAN_OPTIONS UBSAN_OPTIONS

failed=0
summary=()
for t in "${targets[@]}"; do
  log="$BUILD/fuzz/$t.log"
  rc=$(cat "$BUILD/fuzz/$t.rc" 2> /dev/null || echo "?")
  runs=$(grep -aoE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1 || true)
  crashes=$(find "$BUILD/fuzz/artifacts/$t" -type f | wc -l)
  summary+=("$t: ${runs:-?} executions in ${seconds} s, ${crashes} crash/leak/timeout inputs, exit ${rc}")
  if [ "$rc" != 0 ] || [ "$crashes" -ne 0 ]; then
    failed=1
    echo "fuzz: $t failed; the end of its log:"
    tail -n 40 "$log" | cut -c1-300
  fi
done
printf 'fuzz: %s\n' "${summary[@]}"
echo "fuzz: ${#targets[@]} targets, total $(( $(date +%s) - start )) s"
exit $failed
