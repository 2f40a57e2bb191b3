#!/usr/bin/env bash
# The README's "run the main job" command: installs the Debian packages, builds, and runs
# the all_reduce example end to end on the embedded default (a coordinator and two sidecars
# started on loopback, four ranks, everything stopped afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j2
exec bash scripts/run_example.sh build
