#!/usr/bin/env bash
# The README's test command, and CI's (.ci/run): installs the Debian packages, then runs every
# stage through scripts/ci.py:
#   release   Release build (-j2), every suite with ctest
#   asan      the ASan+UBSan build (clang, with the libFuzzer targets; scripts/sanitizers.sh),
#             the suites under it, then each fuzz target for ${COLLSERVE_FUZZ_SECONDS:-20} s
#             from its seed corpus (scripts/fuzz.sh)
#   tsan      the TSan build, the threaded suites under it (scripts/sanitizers.sh)
#   debian13  the Python and c10d suites in a Debian 13 root against its torch 2.6
#             (scripts/debian13.sh; needs root)
# Builds run in a lane of their own at a lower CPU priority (nice 10), beside the tests, and compile
# through ccache (scripts/ccache_env.sh: one cache per machine, /var/cache/collserve/ccache).
# Each test bounds its own time (ctest TIMEOUT) and stops the processes it starts. The run
# ends with a table of each stage's build and test seconds, tests run and cache hit rate
# (docs/ci.md). COLLSERVE_SANITIZERS=0 skips the asan and tsan stages and COLLSERVE_DEBIAN13=0
# the Debian 13 stage (quick local checks; CI runs both).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/install_deps.sh
export COLLSERVE_CI_DEPS_S=$(($(date +%s) - start))
# Every process the suites start checks Abseil's lock order and dies on an inversion (the
# daemons and the SDK do not by default: common/mutex_mode.h).
export COLLSERVE_MUTEX_DEADLOCK_DETECTION=abort
exec /usr/bin/python3 scripts/ci.py
