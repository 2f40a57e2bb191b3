#!/usr/bin/env bash
# The README's test command: installs the Debian packages, builds (Release, -j2) and runs
# every test suite with ctest, then runs each fuzz target for a bounded time (clang,
# libFuzzer; scripts/fuzz.sh), then the torch 2.x stage (scripts/debian13.sh: the Python
# suites in a Debian 13 root against its torch 2.6), then the sanitizer runs
# (scripts/sanitizers.sh: the suite under ASan+UBSan, the store, client, engine and sidecar
# tests under TSan). Each test bounds its own time (ctest TIMEOUT) and stops the processes it
# starts. COLLSERVE_SANITIZERS=0 skips the sanitizer runs and COLLSERVE_DEBIAN13=0 the
# Debian 13 stage (quick local checks; CI runs both).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
# The Debian 13 root (download and unpack, 1 to 5 minutes, cached) is made while the Release
# build compiles; the torch 2.x stage below waits for it (and makes it itself if this failed).
root_pid=""
if [ "${COLLSERVE_DEBIAN13:-1}" != 0 ] && [ "$(id -u)" -eq 0 ]; then
  root_log=$(mktemp /tmp/collserve-debian13-root.XXXXXX.log)
  bash scripts/debian13.sh --root-only > "$root_log" 2>&1 &
  root_pid=$!
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j2
ctest --test-dir build --output-on-failure -j2 --timeout 300
# Fuzzing: ${COLLSERVE_FUZZ_SECONDS:-20} s per target from the seed corpus in tests/fuzz/corpus
# (20 s: CI must end within 90 minutes, and a slow machine's run reached it).
bash scripts/fuzz.sh "${COLLSERVE_FUZZ_SECONDS:-20}"
# torch 2.x: the Python and c10d suites on Debian 13's torch 2.6 (docs/torch.md).
if [ "${COLLSERVE_DEBIAN13:-1}" != 0 ]; then
  if [ -n "$root_pid" ]; then
    root_rc=0
    wait "$root_pid" || root_rc=$?
    echo "=== debian13 root (made in the background, exit $root_rc):"
    tail -n 5 "$root_log"
    rm -f "$root_log"
  fi
  bash scripts/debian13.sh
fi
# Sanitizers: ASan+LSan+UBSan over the whole suite, TSan over the threaded parts.
if [ "${COLLSERVE_SANITIZERS:-1}" != 0 ]; then
  bash scripts/sanitizers.sh
fi
