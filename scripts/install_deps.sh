#!/usr/bin/env bash
# Installs the Debian 12 packages collserve builds, tests and runs with.
#   scripts/install_deps.sh             everything scripts/test.sh needs
#   scripts/install_deps.sh --main-job  only what scripts/main_job.sh builds and runs with
# Safe to re-run: apt-get skips what is already installed. Needs root (or sudo).
set -euo pipefail
# Building the daemons, collservectl and the Python SDK, and running the main job.
packages=(
  build-essential cmake pkg-config ccache lld
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgloo-dev prometheus-cpp-dev libmicrohttpd-dev libgoogle-glog-dev libleveldb-dev libssl-dev openssl
  pybind11-dev python3-dev python3-numpy python3-torch python3-sklearn
  procps
)
if [ "${1:-}" != --main-job ]; then
  packages+=(
    # the tests, benchmarks and the c10d backend
    libgtest-dev libgmock-dev libbenchmark-dev libtorch-dev
    python3-pytest python3-venv python3-pip python3-setuptools python3-wheel
    # network namespaces, fault injection, the flake sweep's load (scripts/flake_sweep.sh)
    iproute2 nftables util-linux stress-ng
    # the ASan tree and the fuzz targets (clang), Prometheus for the monitoring tests, etcd
    # for the replicated store, mmdebstrap for the Debian 13 root
    clang libclang-rt-14-dev
    prometheus
    etcd-server
    mmdebstrap
    # the MPI backend (issue 45): Open MPI's library and mpirun
    libopenmpi-dev openmpi-bin
  )
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install_deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
