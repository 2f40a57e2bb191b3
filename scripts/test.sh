#!/usr/bin/env bash
# The README's test command: installs the Debian packages, builds (Release, -j2) and runs
# every test suite with ctest, then runs each fuzz target for a bounded time (clang,
# libFuzzer; scripts/fuzz.sh), then the sanitizer runs (scripts/sanitizers.sh: the suite
# under ASan+UBSan, the store, client, engine and sidecar tests under TSan). Each test bounds
# its own time (ctest TIMEOUT) and stops the processes it starts. COLLSERVE_SANITIZERS=0
# skips the sanitizer runs (a quick local check; CI runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j2
ctest --test-dir build --output-on-failure -j2 --timeout 300
# Fuzzing: ${COLLSERVE_FUZZ_SECONDS:-60} s per target from the seed corpus in tests/fuzz/corpus.
bash scripts/fuzz.sh "${COLLSERVE_FUZZ_SECONDS:-60}"
# Sanitizers: ASan+LSan+UBSan over the whole suite, TSan over the threaded parts.
if [ "${COLLSERVE_SANITIZERS:-1}" != 0 ]; then
  bash scripts/sanitizers.sh
fi
