#!/usr/bin/env bash
# Sanitizer runs of the test suite (part of scripts/test.sh, so of CI):
#   asan  build-asan (CMake preset asan: clang, AddressSanitizer + LeakSanitizer + UBSan, and
#         the libFuzzer targets that scripts/fuzz.sh runs), every ctest suite but those in
#         tests/sanitizers/asan-exclude.txt; the Python suites with the runtime preloaded.
#   tsan  build-tsan (preset tsan: gcc, ThreadSanitizer), the test binaries listed in
#         tests/sanitizers/tsan-binaries.txt (the store, client, engine and sidecar tests).
# Each configures, builds (-j2, through ccache: scripts/ccache_env.sh) and runs its
# tests. Every sanitized process writes its reports to <build>/sanitizer-logs/ (log_path),
# daemons and ranks that tests start included, whose stderr goes to files the tests delete.
# Exits non-zero if any test fails or any process wrote a report. Prints how long each phase
# took.
# Usage: scripts/sanitizers.sh [--build-only | --test-only] [asan] [tsan]   (default: both,
#        built and tested; scripts/test.sh builds in one lane and tests in another)
#        scripts/sanitizers.sh --asan-unrun-regex   (prints the C++ tests asan leaves out)
# Environment: JOBS (build and ctest parallelism, default 2).
# tests/sanitizers/README.md explains the options, preloads, suppressions and exclusions; the
# lists of what does not run where are data files there, one reason per entry.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=${JOBS:-2}
SAN=$ROOT/tests/sanitizers
source scripts/ccache_env.sh

# list_regex FILE: the entries of a list file (a regular expression for a whole test name,
# then its reason; '#' comments) as one anchored alternation; fails on an entry without a reason.
list_regex() {
  awk -v file="$1" '
    /^[[:space:]]*(#|$)/ {next}
    NF < 2 {printf "%s:%d: \"%s\" has no reason\n", file, NR, $1 > "/dev/stderr"; bad = 1; next}
    {re = re (re == "" ? "" : "|") $1}
    END {if (bad) exit 1; if (re == "") exit 1; printf "^(%s)( |$)", re}' "$1"
}
# list_words FILE: the first field of each entry, space-separated (same checks).
list_words() {
  awk -v file="$1" '
    /^[[:space:]]*(#|$)/ {next}
    NF < 2 {printf "%s:%d: \"%s\" has no reason\n", file, NR, $1 > "/dev/stderr"; bad = 1; next}
    {printf "%s%s", (n++ ? " " : ""), $1}
    END {if (bad) exit 1}' "$1"
}
ASAN_EXCLUDE=$(list_regex "$SAN/asan-exclude.txt")
ASAN_NO_VPTR=$(list_regex "$SAN/asan-no-vptr.txt")
SWEEP_SKIP=$(list_regex "$SAN/sweep-skip.txt")
ASAN_PYTEST_DESELECT=""
for w in $(list_words "$SAN/asan-pytest-deselect.txt"); do
  ASAN_PYTEST_DESELECT="${ASAN_PYTEST_DESELECT:+$ASAN_PYTEST_DESELECT and }not $w"
done
TSAN_BINARIES=$(list_words "$SAN/tsan-binaries.txt")

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

configure() { cmake --preset "$1" >/dev/null; }
build() { cmake --build "$1" -j "$JOBS" "${@:2}"; }
# Prints the tree's compiler-cache hit rate (scripts/ccache_env.sh).
hit_rate() { echo "$(basename "$1"): $(ccache_hit_rate "$1")"; }

build_asan() {
  local build=$ROOT/build-asan
  phase "asan: configure" configure asan
  [ $last_rc -eq 0 ] || return 0
  ccache_stats_log "$build"
  phase "asan: build" build "$build"
  hit_rate "$build"
}

test_asan() {
  local build=$ROOT/build-asan logs=$ROOT/build-asan/sanitizer-logs
  rm -rf "$logs" && mkdir -p "$logs/reports"
  local common="halt_on_error=1:detect_leaks=1:check_initialization_order=1:log_exe_name=1"
  local ubsan="halt_on_error=1:print_stacktrace=1:report_error_type=1:log_path=$logs/reports/ubsan:log_exe_name=1"
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
  # Python suites: /usr/bin/python3 is not instrumented, so clang's shared ASan runtime (which
  # has UBSan's in it) is preloaded, with libstdc++ (else the first C++ throw in a torch or
  # pybind11 module trips ASan's __cxa_throw interceptor: google/sanitizers#934). The preload
  # reaches every program the tests start: tests/sanitizers/bin wraps the procps tools that
  # deadlock under it. Leak checking keeps only the allocating frame (malloc_context_size=2)
  # for the Python suppressions, and skips thread-local storage (use_tls=0: LSan's
  # dynamic-TLS scan crashes in torch processes). The conformance suite runs one seed of 200
  # cases here (the Release and Debian 13 stages run 3 seeds of 300). Bounds on whole
  # programs stretch 3x (daemons.bound): beside another test step a world-3 torch program
  # took past its 120 s under ASan.
  local preload
  preload="$(clang -print-file-name=libclang_rt.asan-x86_64.so) $(gcc -print-file-name=libstdc++.so)"
  phase "asan: ctest (Python)" env PATH="$SAN/bin:$PATH" LD_PRELOAD="$preload" \
    ASAN_OPTIONS="$common:malloc_context_size=2:log_path=$logs/reports/asan" \
    LSAN_OPTIONS="suppressions=$SAN/lsan-python.supp:use_tls=0:print_suppressions=0" UBSAN_OPTIONS="$ubsan" \
    PYTEST_ADDOPTS="-k '$ASAN_PYTEST_DESELECT'" COLLSERVE_CONFORMANCE_SEEDS=1 COLLSERVE_CONFORMANCE_CASES=200 \
    COLLSERVE_TEST_TIMEOUT_SCALE=3 \
    ctest --test-dir "$build" -j "$JOBS" --timeout 600 --output-on-failure --output-log "$logs/ctest-python.log" \
    -R '^python_' -E "$ASAN_EXCLUDE"
  phase "asan: reports" check_reports "$logs"
}

# Only what the TSan tests run: their binaries and the daemons they start.
tsan_targets() {
  local b
  echo collserve-coordinator collserve-sidecar
  for b in $TSAN_BINARIES; do basename "$b"; done
}

build_tsan() {
  local build=$ROOT/build-tsan
  phase "tsan: configure" configure tsan
  [ $last_rc -eq 0 ] || return 0
  ccache_stats_log "$build"
  # shellcheck disable=SC2046
  phase "tsan: build" build "$build" --target $(tsan_targets)
  hit_rate "$build"
}

test_tsan() {
  local build=$ROOT/build-tsan logs=$ROOT/build-tsan/sanitizer-logs
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

do_build=1
do_test=1
case "${1:-}" in
  --build-only) do_test=0; shift ;;
  --test-only) do_build=0; shift ;;
  # The C++ tests the asan stage does not run (its lists' regular expressions), for
  # scripts/ci.py: the Release stage runs these and leaves the others to asan (docs/ci.md).
  --asan-unrun-regex) printf '%s\n' "$ASAN_EXCLUDE|$SWEEP_SKIP"; exit 0 ;;
esac
which=("$@")
[ ${#which[@]} -gt 0 ] || which=(asan tsan)
for w in "${which[@]}"; do
  case $w in
    asan|tsan) ;;
    *) echo "usage: $0 [--build-only | --test-only] [asan] [tsan]" >&2; exit 2 ;;
  esac
  if [ $do_build = 1 ]; then
    "build_$w"
    # A tree that did not build is not tested.
    [ $failed -eq 0 ] || break
  fi
  [ $do_test = 0 ] || "test_$w"
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
