#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, clang, ASan+UBSan) in build-fuzz and runs each
# for SECONDS seconds (default 60) from a copy of its seed corpus. Prints, per target, the
# executions run and the crashes found; exits non-zero if any target crashed, leaked or
# timed out. A crashing input is kept under build-fuzz/artifacts/<target>/: copy it to
# tests/fuzz/regressions/<target>/ so the ordinary suite replays it (fuzz_replay_<target>).
#   bash scripts/fuzz.sh [SECONDS] [TARGET...]     e.g. bash scripts/fuzz.sh 3600 wal_replay
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(tcpstore_protocol wal_replay collective_request coordinator_rpc sidecar_session ops_channel)
start=$(date +%s)
cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
  "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCOLLSERVE_FUZZ=ON -DCOLLSERVE_WITH_NCCL=OFF > /tmp/collserve-fuzz-configure.log 2>&1 || { cat /tmp/collserve-fuzz-configure.log; exit 1; }
cmake --build build-fuzz -j2 --target fuzz_targets
echo "fuzz: built in $(( $(date +%s) - start )) s"
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
failed=0
summary=()
for t in "${targets[@]}"; do
  work="build-fuzz/work/$t"
  artifacts="build-fuzz/artifacts/$t"
  rm -rf "$work" "$artifacts"
  mkdir -p "$work" "$artifacts"
  cp -r "tests/fuzz/corpus/$t/." "$work/"
  [ -d "tests/fuzz/regressions/$t" ] && cp -r "tests/fuzz/regressions/$t/." "$work/"
  log="build-fuzz/$t.log"
  extra=()
  # The coordinator target runs a server on threads of its own: what they hold between
  # inputs is not a leak of the input.
  [ "$t" = coordinator_rpc ] || [ "$t" = sidecar_session ] || [ "$t" = ops_channel ] && extra=(-detect_leaks=0)
  set +e
  "build-fuzz/tests/fuzz/fuzz_$t" "$work" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=3072 \
    -max_len=65536 -print_final_stats=1 -artifact_prefix="$artifacts/" "${extra[@]}" > "$log" 2>&1
  rc=$?
  set -e
  runs=$(grep -aoE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1 || true)
  crashes=$(find "$artifacts" -type f | wc -l)
  summary+=("$t: ${runs:-?} executions in ${seconds} s, ${crashes} crash/leak/timeout inputs, exit ${rc}")
  if [ "$rc" -ne 0 ] || [ "$crashes" -ne 0 ]; then
    failed=1
    echo "fuzz: $t failed; the end of its log:"
    tail -n 40 "$log" | cut -c1-300
  fi
done
printf 'fuzz: %s\n' "${summary[@]}"
echo "fuzz: total $(( $(date +%s) - start )) s"
exit $failed
