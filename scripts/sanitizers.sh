#!/usr/bin/env bash
# Sanitizer runs of the test suite (not part of scripts/test.sh or CI):
#   asan  build-asan (CMake preset asan: AddressSanitizer + LeakSanitizer + UBSan), every
#         ctest suite but the excluded ones below; the Python suites with libasan preloaded.
#   tsan  build-tsan (preset tsan: ThreadSanitizer), the store (memory and etcd), client, engine and sidecar
#         unit and integration tests (by test binary, see TSAN_BINARIES).
# Each configures, builds (-j2, niced) and runs its tests. Every sanitized process writes its
# reports to <build>/sanitizer-logs/ (log_path), daemons and ranks that tests start included,
# whose stderr goes to files the tests delete. Exits non-zero if any test fails or any
# process wrote a report. Prints how long each phase took.
# Usage: scripts/sanitizers.sh [asan] [tsan]   (default: both)
# Environment: JOBS (build and ctest parallelism, default 2).
# tests/sanitizers/README.md explains the options, preloads, suppressions and exclusions.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=${JOBS:-2}
SAN=$ROOT/tests/sanitizers

# Not run under ASan (tests/sanitizers/README.md):
#   install_consumer  builds an uninstrumented program against the installed (instrumented)
#                     SDK; it aborts with "ASan runtime does not come first".
#   AttackTest.OversizedMessagesAreRefusedWithoutHoldingTheirBytes  asserts on the daemon's
#                     RSS: ASan's quarantine and shadow memory keep freed memory resident and
#                     its allocator ignores the daemon's malloc_trim().
#   python_perf       runs the benchmark programs (collserve-perf, torch_perf.py) over every op,
#                     size and memory kind: 396 s under ASan on a slow machine, the longest
#                     Python suite there, for paths the C++ suites already run under ASan
#                     (SurfaceTest: every collective with arena and ordinary tensors). CI
#                     must end within 90 minutes; it runs in the Release suite. The asan
#                     preset does not build the benchmark programs (COLLSERVE_BUILD_BENCH=OFF,
#                     a minute of the build), so the suite is not even registered there.
#   deploy_chart, layering, monitoring_rules, monitoring_dashboard  check the chart, the
#                     include graph and the alert rules and dashboard with helm, bash,
#                     promtool and python: they run no instrumented code.
ASAN_EXCLUDE='^(install_consumer|python_perf|AttackTest\.OversizedMessagesAreRefusedWithoutHoldingTheirBytes|deploy_chart|layering|monitoring_rules|monitoring_dashboard)$'
# The Python suites run under ASan: those that load the instrumented modules
# (_collserve, _collserve_torch) and drive them through every call: the SDK, the TCPStore
# server from torch's client, the ProcessGroup and the c10d backend (less its unchanged
# tutorial and blog programs, which make the same calls: ASAN_PYTEST_DESELECT). Not run
# under ASan, for CI's time (a slow machine's whole run reached 90 minutes): launch,
# security, install and elastic drive the daemons as processes, whose C++ paths the C++
# suites run under ASan (the launcher, TlsTest and TokenTest, ReconfigureTest and LeaveTest),
# or package the SDK (install). All of them run in the Release suite.
ASAN_PYTHON='^python_(sdk|tcpstore|torch_pg|torch_backend)$'
ASAN_PYTEST_DESELECT='not tutorial_programs and not blog_'
# The world-size and host-count sweeps (WorldSizesAndHosts/*: every collective, dtype and
# op for 12 layouts of 1 to 5 ranks on 1 to 3 hosts) run 5 of their layouts under the
# sanitizers: one rank, a single host of 3, 2 hosts of 1 and of 2 ranks, and 3 uneven hosts
# (5 ranks: 2, 2, 1). The other 7 were half of TSan's time and a third of ASan's; they
# repeat the same code paths with other counts and run in the Release suite.
SWEEP_SKIP='^WorldSizesAndHosts/.*/world(2_hosts1|3_hosts2|3_hosts3|4_hosts1|4_hosts3|5_hosts1|5_hosts2)( |$)'
# Run on their own, without UBSan's vptr check (tests/sanitizers/ubsan-no-vptr.supp):
#   AttackTest.RunningOutOfDescriptorsIsSurvived  runs the coordinator out of descriptors on
#                     purpose; UBSan's vptr check then cannot open the pipe it probes memory
#                     with and aborts on a valid object ("invalid vptr", "memory cannot be
#                     printed"). ASan and the other UBSan checks stay on.
ASAN_NO_VPTR='^AttackTest\.RunningOutOfDescriptorsIsSurvived$'
# The TSan run: these test binaries (paths under the build directory).
TSAN_BINARIES="tests/store/memory_store_test tests/server/coordinator_test tests/server/registry_replicas_test tests/server/tcpstore_server_test
  tests/client/init_options_test tests/engine/engine_test tests/engine/device_step_test
  tests/integration/allreduce_test tests/integration/errors_test tests/integration/surface_test
  tests/integration/coordinator_process_test tests/server/etcd_store_test"

declare -a TIMES=()
declare -a DIGEST=()  # one line per sanitizer report, repeated after the phase durations
failed=0
last_rc=0
now() { date +%s; }
phase() {  # phase NAME COMMAND...: runs it, records its duration and result; status in $last_rc
  local name=$1 start rc=0
  shift
  start=$(now)
  echo "=== $name"
  "$@" || rc=$?
  TIMES+=("$(printf '%-28s %5ss  %s' "$name" "$(($(now) - start))" "$([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)")")")
  echo "=== $name: $(($(now) - start))s, exit $rc"
  if [ $rc -ne 0 ]; then failed=1; fi
  last_rc=$rc
  return 0
}

# A report with its frames symbolized here: the runs set symbolize=0, because a daemon
# symbolizing in-process (slow: addr2line on large binaries) is often killed by its test's
# teardown before the stack is written (a CI report once ended after its first line). Raw
# frames are "#N 0xPC  (/path/module+0xOFFSET)"; each becomes "#N 0xPC in FUNCTION FILE:LINE".
symbolize() {
  python3 - "$1" <<'PY'
import re, subprocess, sys
cache = {}
def resolve(module, offset):
    key = (module, offset)
    if key not in cache:
        try:
            out = subprocess.run(["addr2line", "-f", "-C", "-i", "-e", module, offset], capture_output=True,
                                 text=True, timeout=60).stdout.split("\n")
            cache[key] = " in ".join(f"{out[i]} {out[i + 1]}" for i in range(0, len(out) - 1, 2)) or None
        except Exception:
            cache[key] = None
    return cache[key]
frame = re.compile(r"^(\s*#\d+ 0x[0-9a-f]+)\s+\((.+)\+(0x[0-9a-f]+)\)\s*$")
try:
    for line in open(sys.argv[1], errors="replace"):
        m = frame.match(line)
        where = resolve(m.group(2), m.group(3)) if m else None
        sys.stdout.write(f"{m.group(1)} in {where} ({m.group(2)}+{m.group(3)})\n" if where else line)
except BrokenPipeError:  # the reader (head) has enough
    pass
PY
}

# Fails (and prints them) if any process wrote a sanitizer report into $1/reports, or the
# tests' output ($1/ctest-*.log) has a UBSan report: GCC's UBSan runtime ignores log_path
# when ASan is linked too, so its reports go to stderr (and the process aborts).
check_reports() {
  local dir=$1 files bad=0 f
  files=$(find "$dir/reports" -type f -size +0 | sort)
  if [ -n "$files" ]; then
    bad=1
    echo "SANITIZER REPORTS ($(echo "$files" | wc -l) processes; file names are <tool>.<program>.<pid>):"
    for f in $files; do
      echo "----- $f"
      symbolize "$f" | head -c 20000
      DIGEST+=("$(basename "$f"): $({ grep -m1 '^SUMMARY' "$f" || grep -m1 -E 'ERROR|WARNING' "$f"; } | head -c 300)")
      DIGEST+=("    first frames: $(symbolize "$f" | grep -m4 -E '^ +#[0-9]+ ' | sed -E 's/^ +#[0-9]+ 0x[0-9a-f]+ in //' | tr '\n' '|' | head -c 500)")
    done
  fi
  if grep -h -A12 ': runtime error: ' "$dir"/ctest-*.log > "$dir/ubsan-in-test-output.txt"; then
    bad=1
    echo "UBSAN REPORTS in the tests' output (the first ones; all in $dir/ubsan-in-test-output.txt):"
    grep -h ': runtime error: ' "$dir/ubsan-in-test-output.txt" | sed 's/^ *//' | sort | uniq -c | sort -rn | head -20
  fi
  [ $bad -eq 0 ] && echo "no sanitizer reports ($dir)"
  return $bad
}

configure() { nice -n 10 cmake --preset "$1" >/dev/null; }
build() { nice -n 10 cmake --build "$1" -j "$JOBS"; }

run_asan() {
  local build=$ROOT/build-asan logs=$ROOT/build-asan/sanitizer-logs
  phase "asan: configure" configure asan
  [ $last_rc -eq 0 ] || return 0
  phase "asan: build" build "$build"
  [ $last_rc -eq 0 ] || return 0
  rm -rf "$logs" && mkdir -p "$logs/reports"
  local common="halt_on_error=1:detect_leaks=1:check_initialization_order=1:log_exe_name=1"
  local ubsan="halt_on_error=1:print_stacktrace=1:report_error_type=1"
  # C++ suites: full leak checking, no suppressions; frames symbolized afterwards (symbolize()).
  # The fault tests run one trial each (COLLSERVE_FAULT_TRIALS=1; the Release suite runs 2).
  # (The Python suites keep in-process symbolization: their leak suppressions match
  # function names.)
  phase "asan: ctest (C++)" env ASAN_OPTIONS="$common:symbolize=0:log_path=$logs/reports/asan" UBSAN_OPTIONS="$ubsan" \
    COLLSERVE_FAULT_TRIALS=1 \
    ctest --test-dir "$build" -j "$JOBS" --timeout 600 --output-on-failure --output-log "$logs/ctest-cc.log" \
    -E "$ASAN_EXCLUDE|$ASAN_NO_VPTR|$SWEEP_SKIP|^python_"
  phase "asan: ctest (no vptr check)" env ASAN_OPTIONS="$common:symbolize=0:log_path=$logs/reports/asan" \
    UBSAN_OPTIONS="$ubsan:suppressions=$SAN/ubsan-no-vptr.supp" \
    ctest --test-dir "$build" --timeout 600 --output-on-failure --output-log "$logs/ctest-no-vptr.log" \
    -R "$ASAN_NO_VPTR"
  # Python suites: /usr/bin/python3 is not instrumented, so the runtime is preloaded, with
  # libstdc++ (else the first C++ throw in a torch or pybind11 module trips ASan's __cxa_throw
  # interceptor: google/sanitizers#934). The preload reaches every program the tests start:
  # tests/sanitizers/bin wraps the procps tools that deadlock under it. Leak checking keeps
  # only the allocating frame (malloc_context_size=2) for the Python suppressions, and skips
  # thread-local storage (use_tls=0: LSan's dynamic-TLS scan crashes in torch processes).
  local preload
  preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
  phase "asan: ctest (Python)" env PATH="$SAN/bin:$PATH" LD_PRELOAD="$preload" \
    ASAN_OPTIONS="$common:malloc_context_size=2:log_path=$logs/reports/asan" \
    LSAN_OPTIONS="suppressions=$SAN/lsan-python.supp:use_tls=0:print_suppressions=0" UBSAN_OPTIONS="$ubsan" \
    PYTEST_ADDOPTS="-k '$ASAN_PYTEST_DESELECT'" \
    ctest --test-dir "$build" -j "$JOBS" --timeout 600 --output-on-failure --output-log "$logs/ctest-python.log" \
    -R "$ASAN_PYTHON" -E "$ASAN_EXCLUDE"
  phase "asan: reports" check_reports "$logs"
}

run_tsan() {
  local build=$ROOT/build-tsan logs=$ROOT/build-tsan/sanitizer-logs
  phase "tsan: configure" configure tsan
  [ $last_rc -eq 0 ] || return 0
  # Only what the TSan tests run: their binaries and the daemons they start.
  local targets=(collserve-coordinator collserve-sidecar)
  local b
  for b in $TSAN_BINARIES; do targets+=("$(basename "$b")"); done
  phase "tsan: build" nice -n 10 cmake --build "$build" -j "$JOBS" --target "${targets[@]}"
  [ $last_rc -eq 0 ] || return 0
  rm -rf "$logs" && mkdir -p "$logs/reports"
  # ctest numbers of the tests whose command is one of TSAN_BINARIES.
  local ids
  ids=$(ctest --test-dir "$build" --show-only=json-v1 | python3 -c '
import json, re, sys
want = sys.argv[1].split()
skip = re.compile(sys.argv[2])
tests = json.load(sys.stdin)["tests"]
print(",".join(str(i + 1) for i, t in enumerate(tests)
               if any((t.get("command") or [""])[0].endswith("/" + w) for w in want) and not skip.search(t["name"])))' \
    "$TSAN_BINARIES" "$SWEEP_SKIP")
  if [ -z "$ids" ]; then
    echo "no tests found for $TSAN_BINARIES" >&2
    failed=1
    return 0
  fi
  echo "tsan: $(echo "$ids" | tr ',' '\n' | wc -l) tests"
  phase "tsan: ctest" env \
    TSAN_OPTIONS="halt_on_error=0:second_deadlock_stack=1:history_size=4:ignore_noninstrumented_modules=1:suppressions=$SAN/tsan.supp:log_path=$logs/reports/tsan:log_exe_name=1" \
    ctest --test-dir "$build" -j "$JOBS" --timeout 600 --output-on-failure --output-log "$logs/ctest-tsan.log" \
    -I "0,0,0,$ids"
  phase "tsan: reports" check_reports "$logs"
}

which=("$@")
[ ${#which[@]} -gt 0 ] || which=(asan tsan)
for w in "${which[@]}"; do
  case $w in
    asan) run_asan ;;
    tsan) run_tsan ;;
    *) echo "usage: $0 [asan] [tsan]" >&2; exit 2 ;;
  esac
done

echo
echo "=== phase durations"
printf '%s\n' "${TIMES[@]}"
if [ ${#DIGEST[@]} -gt 0 ]; then
  # Repeated here so that the end of a long log (all that CI may keep) names them.
  echo
  echo "=== sanitizer reports (each printed in full under its phase above)"
  printf '%s\n' "${DIGEST[@]}" | head -60
fi
if [ $failed -ne 0 ]; then
  echo "sanitizers: FAILED"
  exit 1
fi
echo "sanitizers: OK"
