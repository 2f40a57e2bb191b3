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
#
# Also packs .gpu/ into .gpu.tgz (about a third of its size): carry that to the device
# machine (its carry limit is 64 MiB; .gpu/ itself is near 60 MB); run.sh unpacks it.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
grep -q '^COLLSERVE_WITH_CUDA' "$build/CMakeCache.txt"
cmake --build "$build" -j2 --target collserve-coordinator collserve-sidecar collserve-perf collserve_client_shared \
  collserve-gpu-event-rtt collservectl nccl_communicator_test cuda_device_test >/dev/null
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib .gpu/include
cp "$build/server/collserve-coordinator" "$build/server/collserve-sidecar" "$build/server/collservectl" \
  "$build/bench/collserve-perf" "$build/bench/collserve-gpu-event-rtt" .gpu/bin/
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
strip --strip-unneeded .gpu/bin/* .gpu/lib/* 2>/dev/null || true
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
grep -qx '/.gpu.tgz' .git/info/exclude 2>/dev/null || echo '/.gpu.tgz' >> .git/info/exclude
tar -czf .gpu.tgz .gpu
du -sh .gpu .gpu.tgz
size=$(stat -c %s .gpu.tgz)
if [ "$size" -gt $((60 * 1024 * 1024)) ]; then
  echo "bundle.sh: .gpu.tgz is $size bytes, near the device tool's 64 MiB carry limit" >&2
  exit 1
fi
