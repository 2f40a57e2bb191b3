#!/usr/bin/env bash
# The c10d backend's CPU suite (tests/python/test_torch_backend.py, then torch_pg's,
# tests/python/test_torch_pg.py) against the torch of a
# device machine (PyTorch 2.x from pip, newer than Debian's), a further check of the torch
# 2.x port (docs/torch.md). Run from the repository root on that machine, with .gpu/ made by
# tests/gpu/bundle.sh here:
#
#   bash tests/gpu/torch_cpu.sh OUT_DIR [pytest -k expression]
#
# It compiles the two Python modules for that machine's Python and torch (with the ABI flags
# torch reports, as CMake does here) against the carried SDK, lays them out with the carried
# daemons as a build tree, and runs the suite. pytest comes from the machine, else from
# .gpu/pytest (Debian 12's, carried by bundle.sh). Logs go to OUT_DIR.
set -uo pipefail
out=${1:?usage: torch_cpu.sh OUT_DIR [pytest -k expression]}
filter=${2:-}
mkdir -p "$out"
root=$PWD
B=/tmp/collserve-torch-build
rm -rf "$B" && mkdir -p "$B/server" "$B/python/collserve"
cp .gpu/bin/collserve-coordinator .gpu/bin/collserve-sidecar .gpu/bin/collservectl "$B/server/"
cp python/collserve/*.py .gpu/lib/libcollserve_client.so "$B/python/collserve/"
export LD_LIBRARY_PATH=$root/.gpu/lib:${LD_LIBRARY_PATH:-}
suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
python3 -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])' | tee "$out/versions.txt"
# torch's include and lib directories and ABI flags (torch.utils.cpp_extension's; newer
# torch builds with a pybind11 that has no such tags, and reports none).
read -r tdir abi < <(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__), int(torch._C._GLIBCXX_USE_CXX11_ABI))')
tags=$(python3 -c 'import torch
for n in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
    v = getattr(torch._C, "_PYBIND11_" + n, None)
    if v is not None: print(f"-DPYBIND11_{n}=\"{v}\"", end=" ")')
# The module must share pybind11's type registry with torch._C. pip's torch wheels carry the
# pybind11 headers torch was built with (<torch>/include/pybind11): build with exactly those
# (as python/CMakeLists.txt does), ahead of any pybind11 on the machine (-I dirs are searched
# before -isystem ones, so a pip pybind11's -I would win: the first GPU run's "Unregistered
# type" failures). Without them, a pybind11 from the machine with the internals version
# torch's registered (a pip pybind11 may be newer than torch's: 3.1's default is 12, torch
# 2.11's is 11).
if [ -f "$tdir/include/pybind11/pybind11.h" ]; then
  pybind="-I$tdir/include $(python3-config --includes)"
  echo "pybind11: torch's own ($tdir/include/pybind11)"
else
  pybind=$(python3 -m pybind11 --includes 2> /dev/null || python3-config --includes)
  echo "pybind11: the machine's ($pybind)"
fi
internals=$(python3 -c 'import ctypes, re, torch
api = ctypes.pythonapi
api.PyInterpreterState_Get.restype = ctypes.c_void_p
api.PyInterpreterState_GetDict.restype = ctypes.py_object
api.PyInterpreterState_GetDict.argtypes = [ctypes.c_void_p]
keys = list(api.PyInterpreterState_GetDict(api.PyInterpreterState_Get())) + list(__builtins__.__dict__)
print(next((m.group(1) for k in keys for m in [re.match(r"__pybind11_internals_v(\d+)", str(k))] if m), ""))')
[ -n "$internals" ] && [ ! -f "$tdir/include/pybind11/pybind11.h" ] && tags="$tags -DPYBIND11_INTERNALS_VERSION=$internals"
absl=$(ls .gpu/lib/libabsl_*.so* | tr '\n' ' ')
g++ -O2 -std=c++17 -shared -fPIC python/_collserve.cc python/common/call_sites.cc -I. -Iinclude -I.gpu/include $pybind -L"$B/python/collserve" -lcollserve_client $absl -Wl,-rpath,'$ORIGIN' \
  -o "$B/python/collserve/_collserve$suffix" 2> "$out/compile_collserve.log" ||
  { echo "FAILED: compiling _collserve"; tail -20 "$out/compile_collserve.log"; exit 1; }
g++ -O2 -std=c++17 -shared -fPIC python/c10d/module.cc python/c10d/collserve_c10d.cc python/common/call_sites.cc -I. -Iinclude -I.gpu/include \
  -isystem "$tdir/include" -isystem "$tdir/include/torch/csrc/api/include" $pybind \
  -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI="$abi" $tags \
  -L"$B/python/collserve" -lcollserve_client $absl -L"$tdir/lib" -lc10 -ltorch_cpu -ltorch -ltorch_python \
  -Wl,-rpath,"\$ORIGIN:$tdir/lib" -o "$B/python/collserve/_collserve_torch$suffix" 2> "$out/compile_c10d.log" ||
  { echo "FAILED: compiling _collserve_torch"; tail -30 "$out/compile_c10d.log"; exit 1; }
echo "compiled the modules for torch $(cut -d' ' -f2 "$out/versions.txt") (cxx11 abi $abi; $tags; $pybind)"
pythonpath=$B/python
python3 -c 'import pytest' 2> /dev/null || pythonpath=$pythonpath:$root/.gpu/pytest
cd "$root"
PYTHONPATH=$pythonpath COLLSERVE_BUILD_DIR=$B PYTHONUNBUFFERED=1 timeout -k 10 420 \
  python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_torch_backend.py ${filter:+-k "$filter"} \
  > "$out/test_torch_backend.log" 2>&1
rc=$?
grep -E "passed|failed|^FAILED|^SKIPPED|^ERROR" "$out/test_torch_backend.log" | tail -n 30
echo "=== test_torch_backend.py: exit $rc"
# torch_pg, the torch 2.x backend over the Python SDK (its CUDA calls: tests/gpu/torch_cuda.py).
PYTHONPATH=$pythonpath COLLSERVE_BUILD_DIR=$B PYTHONUNBUFFERED=1 timeout -k 10 240 \
  python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_torch_pg.py > "$out/test_torch_pg.log" 2>&1
rc_pg=$?
grep -E "passed|failed|^FAILED|^SKIPPED|^ERROR" "$out/test_torch_pg.log" | tail -n 30
echo "=== test_torch_pg.py: exit $rc_pg"
[ $rc -eq 0 ] && [ $rc_pg -eq 0 ]
