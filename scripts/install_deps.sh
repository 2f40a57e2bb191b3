#!/usr/bin/env bash
# Installs the Debian 12 packages collserve builds, tests and runs with.
# Safe to re-run: apt-get skips what is already installed. Needs root (or sudo).
set -euo pipefail
packages=(
  build-essential cmake pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgloo-dev prometheus-cpp-dev libgoogle-glog-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  pybind11-dev python3-dev python3-numpy python3-pytest python3-venv python3-pip python3-setuptools python3-wheel
  python3-torch libtorch-dev python3-sklearn
  iproute2 nftables procps util-linux openssl libssl-dev
  clang libclang-rt-14-dev
  prometheus
  etcd-server
  libleveldb-dev
  mmdebstrap
)
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
