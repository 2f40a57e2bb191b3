#!/usr/bin/env bash
# Packs what the GPU checks need into .gpu/ (ignored by git) for a machine with an NVIDIA GPU
# but without gRPC, Abseil or protobuf (the device tool's machines: Ubuntu 24.04, CUDA 13,
# PyTorch 2.x): the daemons and collserve-perf built here with CUDA, the SDK's shared
# library, every shared library they load that is not the C/C++ runtime, the CUDA driver
# or NCCL (taken there from the machine), and Abseil's headers (tests/gpu/run.sh compiles
# the Python module there, for that machine's Python); collservectl and Debian's pytest for
# tests/gpu/torch_cpu.sh (the c10d backend's CPU suite against that machine's torch).
#
#   bash tests/gpu/bundle.sh [build-dir]      # default build/ (configured with CUDA)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
grep -q '^COLLSERVE_WITH_CUDA' "$build/CMakeCache.txt"
cmake --build "$build" -j2 --target collserve-coordinator collserve-sidecar collserve-perf collserve_client_shared \
  collservectl nccl_communicator_test cuda_device_test >/dev/null
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib .gpu/include
cp "$build/server/collserve-coordinator" "$build/server/collserve-sidecar" "$build/server/collservectl" \
  "$build/bench/collserve-perf" .gpu/bin/
cp "$build/tests/backends/nccl_communicator_test" "$build/tests/backends/cuda_device_test" .gpu/bin/
cp "$build/python/collserve/libcollserve_client.so" .gpu/lib/
for f in .gpu/bin/* .gpu/lib/libcollserve_client.so; do
  ldd "$f" | awk '$3 ~ /^\// {print $3}'
done | sort -u | grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s|libdl|libpthread|librt|ld-linux[^/]*|libcuda|libnccl)\.so' |
  while read -r lib; do cp -L "$lib" .gpu/lib/; done
cp -r /usr/include/absl .gpu/include/
mkdir -p .gpu/pytest
for p in pytest _pytest pluggy iniconfig packaging attr attrs py py.py; do
  cp -r "/usr/lib/python3/dist-packages/$p" .gpu/pytest/
done
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
du -sh .gpu
