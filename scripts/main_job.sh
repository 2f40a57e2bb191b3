#!/usr/bin/env bash
# The README's "run the main job" command: installs the Debian packages it needs, builds only
# what it runs (the daemons, collservectl and the Python SDK; scripts/test.sh builds the rest),
# and runs the main job: distributed synchronous SGD on scikit-learn's digits
# (examples/digits_sgd.py), four ranks under `collserve launch` with its embedded default (a
# coordinator and a sidecar started on loopback and stopped afterwards). Prints each rank's
# loss per epoch and the test accuracy; exits non-zero if a rank fails or the accuracy is
# under 90%.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh --main-job
source scripts/ccache_env.sh
# Tests and benchmarks off here (scripts/ci.py turns them on again in the same tree).
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCOLLSERVE_BUILD_TESTS=OFF -DCOLLSERVE_BUILD_BENCH=OFF > /dev/null
cmake --build build -j2 --target collserve-coordinator collserve-sidecar collservectl _collserve collserve_python_sources
export PYTHONPATH="$PWD/build/python${PYTHONPATH:+:$PYTHONPATH}"
exec /usr/bin/python3 -m collserve.launch --nproc_per_node 4 examples/digits_sgd.py --min_accuracy 0.9 "$@"
