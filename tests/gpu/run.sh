#!/usr/bin/env bash
# The GPU checks of docs/gpu.md, in one go on a machine with an NVIDIA GPU, CUDA 13 and
# PyTorch 2.x (the device tool's machines), from the repository root with .gpu/ (or
# .gpu.tgz, the device tool's carry: its 64 MiB limit holds the archive, not the tree) made by
# tests/gpu/bundle.sh on the build machine:
#
#   bash tests/gpu/run.sh OUT_DIR [all | PARTS]     PARTS: a comma list of unit,sdk,torch,perf,ddp
#
# `all` runs every part; where one device call may take at most 600 s, run `unit,sdk,torch`
# and `perf,ddp` as two calls.
#
# It compiles the Python module for this machine's Python against the carried SDK, then
# runs: the GPU unit tests (NCCL communicator, the sidecar's CUDA kernels); the Python SDK's
# CUDA calls with 1 and 4 ranks (tests/gpu/sdk_cuda.py: results and stream ordering) and a GPU
# stuck past the op timeout (tests/gpu/timeout_cuda.py: an error, not a hang); torch.distributed
# under backend "collserve" (collserve.torch_pg) with CUDA tensors, every call
# (tests/gpu/torch_cuda.py), and the project's torch suites on this machine's torch
# (tests/gpu/torch_cpu.sh); collserve-perf
# --device=cuda for one rank (NCCL n=1 through the sidecar against raw NCCL on the same
# buffer) and for 4 ranks sharing the GPU (against the device's copy bound), with every op's
# result checked; and the DDP comparison (bench/gpu/ddp_compare.py). Logs go to OUT_DIR.
set -uo pipefail
out=${1:?usage: run.sh OUT_DIR [all | unit,sdk,torch,perf,ddp]}
what=${2:-all}
part() { [ "$what" = all ] || [[ ",$what," == *",$1,"* ]]; }
mkdir -p "$out"
root=$PWD
if [ ! -d .gpu ] && [ -f .gpu.tgz ]; then tar -xzf .gpu.tgz; fi
nccl_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH=$root/.gpu/lib:${nccl_lib}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
pkg=/tmp/collserve-py
rm -rf "$pkg" && mkdir -p "$pkg/collserve/bin"
cp python/collserve/*.py "$pkg/collserve/"
cp .gpu/lib/libcollserve_client.so "$pkg/collserve/"
cp .gpu/bin/collserve-coordinator .gpu/bin/collserve-sidecar "$pkg/collserve/bin/"
suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
# pybind11: the copy a pip torch carries (<torch>/include/pybind11, as tests/gpu/torch_cpu.sh),
# else a pip pybind11, else the system's headers; and this Python's headers.
tdir=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)
if [ -n "$tdir" ] && [ -f "$tdir/include/pybind11/pybind11.h" ]; then
  pybind="-I$tdir/include -I$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
else
  pybind=$(python3 -m pybind11 --includes 2> /dev/null || python3-config --includes)
fi
echo "pybind11 and Python headers: $pybind"
g++ -O2 -std=c++17 -shared -fPIC python/_collserve.cc python/common/call_sites.cc -I. -Iinclude -I.gpu/include $pybind \
  -L"$pkg/collserve" -lcollserve_client .gpu/lib/libabsl_*.so* -Wl,-rpath,'$ORIGIN' \
  -o "$pkg/collserve/_collserve$suffix" || { echo "FAILED: compiling _collserve"; exit 1; }
export PYTHONPATH=$pkg:${PYTHONPATH:-}
export COLLSERVE_BIN_DIR=$pkg/collserve/bin PYTHONUNBUFFERED=1
python3 -c 'import collserve._collserve as c; print("collserve module: cuda_available =", c.cuda_available())'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
status=0
run() {  # run NAME COMMAND...: logs to OUT_DIR/NAME.log, bounded to RUN_TIMEOUT s (default 300)
  local name=$1; shift
  echo "=== $name: $*"
  timeout -k 10 "${RUN_TIMEOUT:-300}" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  grep -v -E '^[IWE][0-9]{8} |^\[rank[1-9]' "$out/$name.log" | tail -n 40
  echo "=== $name: exit $rc"
  [ $rc -eq 0 ] || status=1
}
perf=.gpu/bin/collserve-perf
launch="python3 -m collserve launch --nproc_per_node"

if part unit; then
  [ -x .gpu/bin/nccl_communicator_test ] && run unit_nccl .gpu/bin/nccl_communicator_test
  [ -x .gpu/bin/cuda_device_test ] && run unit_cuda_device .gpu/bin/cuda_device_test
fi
if part sdk; then
  run sdk_cuda_1rank $launch 1 tests/gpu/sdk_cuda.py
  run sdk_cuda_4ranks $launch 4 tests/gpu/sdk_cuda.py
  run timeout_cuda $launch 1 tests/gpu/timeout_cuda.py
  # One GPU per rank (COLLSERVE_CUDA_PATH=nccl): the same calls with NCCL in the rank (one rank:
  # all that one GPU allows; gather/scatter's piece to itself is a copy).
  run sdk_cuda_rank_nccl_1rank env COLLSERVE_CUDA_PATH=nccl $launch 1 tests/gpu/sdk_cuda.py
fi
if part torch; then
  # torch.distributed's own calls under backend "collserve" on CUDA tensors: ranks sharing the
  # GPU through the sidecar, and one rank running NCCL itself.
  run torch_cuda_1rank $launch 1 tests/gpu/torch_cuda.py
  run torch_cuda_4ranks $launch 4 tests/gpu/torch_cuda.py
  run torch_cuda_rank_nccl_1rank env COLLSERVE_CUDA_PATH=nccl $launch 1 tests/gpu/torch_cuda.py
  # The project's torch suites (the c10d backend's and torch_pg's, CPU tensors) on this torch.
  RUN_TIMEOUT=720 run torch_suites bash tests/gpu/torch_cpu.sh "$out/torch_suites"
fi
if part perf; then
  # The per-op cost table (1 KiB to 1 GiB) against raw NCCL in the same output: one rank, NCCL
  # n=1 through the sidecar (target: >= 0.9x raw NCCL from 1 MiB up), and NCCL in the rank
  # (COLLSERVE_CUDA_PATH=nccl: one GPU per rank).
  run perf_1rank_all_reduce $launch 1 --no_python $perf --device=cuda -o all_reduce -b 1K -e 1G -f 4 -n 50 -w 10
  run perf_1rank_all_reduce_rank_nccl env COLLSERVE_CUDA_PATH=nccl $launch 1 --no_python $perf --device=cuda \
    -o all_reduce -b 1K -e 1G -f 4 -n 50 -w 10
  # Item 4 (per-op cost of the sidecar path, target <= 15 us at one rank, or the derived
  # limit): one op at a time (-z 1) on both paths, and the floor of any sidecar design on this
  # machine: two processes handing interprocess events back and forth, no collserve code
  # (bench/gpu_event_rtt.cc).
  run perf_1rank_all_reduce_blocking $launch 1 --no_python $perf --device=cuda -o all_reduce -b 1K -e 1M -f 32 \
    -n 2000 -w 200 -z 1
  run perf_1rank_all_reduce_blocking_rank_nccl env COLLSERVE_CUDA_PATH=nccl $launch 1 --no_python $perf \
    --device=cuda -o all_reduce -b 1K -e 1M -f 32 -n 2000 -w 200 -z 1
  run gpu_event_rtt .gpu/bin/collserve-gpu-event-rtt -n 5000 -w 500 --depth 16
  # Target: 4 ranks sharing the GPU, all_reduce 64 MiB float32 >= 60% of the copy bound.
  run perf_4ranks_all_reduce $launch 4 --no_python $perf --device=cuda -o all_reduce -b 1M -e 256M -f 4 -n 100 -w 10
  for op in broadcast all_gather reduce_scatter; do
    run "perf_4ranks_$op" $launch 4 --no_python $perf --device=cuda -o $op -b 4K -e 64M -f 16 -n 20 -w 5
    run "perf_1rank_$op" $launch 1 --no_python $perf --device=cuda -o $op -b 4K -e 64M -f 16 -n 20 -w 5
  done
fi
if part ddp; then
  [ -f bench/gpu/ddp_run.sh ] && run ddp bash bench/gpu/ddp_run.sh "$out"
fi
echo "GPU checks: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
