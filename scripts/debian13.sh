#!/usr/bin/env bash
# The torch 2.x stage: builds collserve in a Debian 13 (trixie) root and runs the Python
# suites there against Debian 13's torch 2.6 (the c10d backend, torch_pg, the TCPStore
# endpoint against torch 2.6's own client, the launcher, elastic jobs, the SDK).
#
# The root is made with mmdebstrap from the Debian mirror this machine's apt already uses
# (about 2 GB, 1 to 2 minutes) and cached in $COLLSERVE_DEBIAN13_CACHE (default
# /var/cache/collserve/debian13), keyed by the package list below: a later run on the same
# machine reuses it (COLLSERVE_DEBIAN13_REFRESH=1 makes a fresh one). The sources (the
# checkout's tracked files as they are on disk) are copied into the root and built there
# from scratch, Release, only the targets the Python suites use. Needs root (mounts, chroot).
#
# Usage: scripts/debian13.sh [pytest file under tests/python ...]   (default: every suite below)
#        scripts/debian13.sh --root-only   only makes (or finds) the cached root; scripts/ci.py
#                                          runs it from the start, beside the Release build
#        scripts/debian13.sh --build-only  makes the root if needed and builds; --test-only runs
#                                          the suites on what the last build left in the root
# The build compiles through ccache (the Debian 13 root's own), its cache kept outside the
# root in $COLLSERVE_DEBIAN13_CCACHE (default /var/cache/collserve/ccache-debian13) and bind-
# mounted at /ccache; its hit counts are copied to build-debian13/ccache-stats.log here.
# Environment: JOBS (build and test parallelism, default 2); COLLSERVE_TEST_FORKSERVER=0 starts
# every rank of the suites as a fresh process (tests/python/forkserver.py).
# Prints the time of each phase; exits non-zero when a suite fails.
#
# Debian 13's torch is built without libuv: torch's env:// rendezvous needs USE_LIBUV=0 there
# (its default asks for libuv and fails), which this stage sets for the suites, as a user of
# that torch must (docs/torch.md).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
JOBS=${JOBS:-2}
PACKAGES=build-essential,cmake,pkg-config,libbenchmark-dev,libgtest-dev,libgmock-dev,libgrpc++-dev,protobuf-compiler-grpc,libprotobuf-dev,protobuf-compiler,libgloo-dev,libabsl-dev,prometheus-cpp-dev,libmicrohttpd-dev,libgoogle-glog-dev,zlib1g-dev,ccache,lld,pybind11-dev,python3-dev,python3-numpy,python3-pytest,python3-setuptools,python3-torch,libtorch-dev,python3-sklearn,procps,iproute2,openssl,etcd-server,libleveldb-dev,git
SUITES=(torch_backend torch_pg tcpstore launch elastic sdk security conformance)
# The conformance suite runs one seed of 300 cases here, seed 4, which no other stage runs
# (Release runs seeds 1-3, asan seed 1): torch 2.6 gets cases of its own at a third of the
# time.
# pytest -k selections of the suites whose other tests run no torch (the daemons, the
# launcher and the SDK on numpy arrays): those run in the Release stage; here only what torch
# 2.6 changes. The tutorial and blog programs of torch_backend make the same calls as its own
# tests; of test_elastic only the DDP programs go through the c10d backend (the others run
# the SDK's own recovery, which no torch version changes). Debian 13's torch has no libuv, so
# the launcher gives its ranks rank 0's store, never the coordinator's TCPStore endpoint: the
# test of launches through that endpoint runs in the Release stage only.
declare -A SELECT=(
  [elastic]="ddp"
  [launch]="kubeflow or error_files or torchrun or main_job or gradient_averaging"
  [sdk]="torch_tensors"
  [security]="c10d"
  [torch_backend]="not tutorial_programs and not blog_ and not long_lived_coordinators_tcpstore"
)
ROOT_ONLY=0
DO_BUILD=1
DO_TEST=1
case "${1:-}" in
  --root-only) ROOT_ONLY=1 ;;
  --build-only) DO_TEST=0 ;;
  --test-only) DO_BUILD=0 ;;
  *) [ $# -eq 0 ] || SUITES=("$@") ;;
esac

CACHE=${COLLSERVE_DEBIAN13_CACHE:-/var/cache/collserve/debian13}
CCACHE_HOST_DIR=${COLLSERVE_DEBIAN13_CCACHE:-/var/cache/collserve/ccache-debian13}
KEY=$(printf '%s\n' "$PACKAGES" trixie v1 | sha256sum | cut -c1-12)
ROOT=$CACHE/root-$KEY
declare -a TIMES=()
phase_start=0
phase() { phase_start=$(date +%s); echo "=== debian13: $1"; }
phase_end() { local d=$(( $(date +%s) - phase_start )); TIMES+=("$1: ${d}s"); echo "=== debian13: $1: ${d}s"; }

if [ "$(id -u)" -ne 0 ]; then
  echo "debian13: needs root (mmdebstrap, mounts, chroot)" >&2
  exit 2
fi
command -v mmdebstrap > /dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap

# ---- the root (cached) ----
if [ "${COLLSERVE_DEBIAN13_REFRESH:-0}" = 1 ] || [ ! -e "$ROOT/.complete" ]; then
  phase "mmdebstrap"
  mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/*.sources 2> /dev/null | grep -v security | head -n 1 || true)
  if [ -z "$mirror" ]; then
    mirror=$(awk '$1 == "deb" && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2> /dev/null || true)
  fi
  mirror=${mirror:-http://deb.debian.org/debian}
  mkdir -p "$CACHE"
  rm -rf "$ROOT.new" "$ROOT"
  mmdebstrap --quiet --variant=apt --include="$PACKAGES" trixie "$ROOT.new" "$mirror"
  touch "$ROOT.new/.complete"
  mv "$ROOT.new" "$ROOT"
  phase_end "mmdebstrap"
fi
if [ $ROOT_ONLY = 1 ]; then
  echo "debian13: root ready ($ROOT)"
  exit 0
fi

# ---- mounts (undone on exit) ----
mounted=()
cleanup() {
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2> /dev/null || true; done
}
trap cleanup EXIT
mount_in() {  # mount_in <target under the root> <mount arguments...>
  local target=$ROOT$1; shift
  mkdir -p "$target"
  mountpoint -q "$target" && umount -l "$target"
  mount "$@" "$target"
  mounted+=("$target")
}
mount_in /proc --bind /proc
mount_in /dev --bind /dev
mount_in /dev/shm -t tmpfs -o size=50% tmpfs
mount_in /tmp -t tmpfs -o size=50% tmpfs
mkdir -p "$CCACHE_HOST_DIR"
mount_in /ccache --bind "$CCACHE_HOST_DIR"
cp /etc/hosts /etc/resolv.conf "$ROOT/etc/" 2> /dev/null || true

# Commands in the root: a clean environment (none of this machine's PATH or COLLSERVE_*).
in_root() { chroot "$ROOT" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  LANG=C.UTF-8 "$@"; }

# ---- sources and build ----
if [ $DO_BUILD = 1 ]; then
phase "build"
rm -rf "$ROOT/src"
mkdir -p "$ROOT/src"
git -C "$SRC" ls-files -z | (cd "$SRC" && tar --null -T - -cf - 2> /dev/null) | tar -x -C "$ROOT/src"
# The root's ccache, with the same settings as scripts/ccache_env.sh's (base directory: the
# sources' folder in the root, so every run's copy hits).
in_root env CCACHE_DIR=/ccache CCACHE_BASEDIR=/src CCACHE_NOHASHDIR=1 CCACHE_DEPEND=1 CCACHE_MAXSIZE=4G \
  CCACHE_STATSLOG=/src/build/ccache-stats.log sh -c "mkdir -p /src/build && \
  cd /src && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCOLLSERVE_BUILD_TESTS=OFF > build-configure.log 2>&1 \
  || { cat build-configure.log; exit 1; }; grep 'collserve: ' build-configure.log; \
  cmake --build build -j$JOBS --target collserve-coordinator collserve-sidecar collservectl _collserve _collserve_torch \
  collserve_python_sources 2>&1 | grep -E 'error|warning|Error' || true; \
  test -f build/python/collserve/_collserve_torch*.so || { echo 'debian13: the c10d backend was not built'; exit 1; }"
in_root python3 -c "import torch; print('debian13: torch', torch.__version__, 'python', __import__('sys').version.split()[0])"
mkdir -p "$SRC/build-debian13"
cp "$ROOT/src/build/ccache-stats.log" "$SRC/build-debian13/ccache-stats.log" 2> /dev/null || : > "$SRC/build-debian13/ccache-stats.log"
echo "debian13: build: $(awk '/^(direct|preprocessed)_cache_hit$/ {h++} /^cache_miss$/ {m++} END {printf "%d of %d compiles from the cache", h, h + m}' "$SRC/build-debian13/ccache-stats.log")"
phase_end "build"
fi
if [ $DO_TEST = 0 ]; then
  echo "=== debian13: phase durations"
  printf '  %s\n' "${TIMES[@]}"
  exit 0
fi
if [ ! -f "$ROOT/src/build/python/collserve/__init__.py" ]; then
  echo "debian13: nothing built in $ROOT/src (run scripts/debian13.sh --build-only first)" >&2
  exit 1
fi

# ---- the suites, JOBS at a time ----
phase "pytest"
mkdir -p "$ROOT/src/build/pytest-logs"
export -f in_root
export ROOT
# Each suite's -k selection travels in a file (xargs -I would split a quoted expression).
for s in "${SUITES[@]}"; do printf '%s' "${SELECT[$s]:-}" > "$ROOT/src/build/pytest-logs/$s.select"; done
printf '%s\n' "${SUITES[@]}" | xargs -P "$JOBS" -I{} bash -c 'in_root "$@"' _ USE_LIBUV=0 PYTHONPATH=/src/build/python \
  COLLSERVE_MUTEX_DEADLOCK_DETECTION="${COLLSERVE_MUTEX_DEADLOCK_DETECTION:-abort}" \
  COLLSERVE_TEST_FORKSERVER="${COLLSERVE_TEST_FORKSERVER:-1}" COLLSERVE_CONFORMANCE_SEEDS="${COLLSERVE_CONFORMANCE_SEEDS:-4}" \
  COLLSERVE_BUILD_DIR=/src/build sh -c 'cd /src && timeout 1200 python3 -m pytest -q -p no:cacheprovider \
  -k "$(cat build/pytest-logs/{}.select)" tests/python/test_{}.py > build/pytest-logs/{}.log 2>&1; \
  echo "$?" > build/pytest-logs/{}.rc' || true
failed=0
for s in "${SUITES[@]}"; do
  rc=$(cat "$ROOT/src/build/pytest-logs/$s.rc" 2> /dev/null || echo 1)
  echo "debian13: test_$s.py: $(tail -n 1 "$ROOT/src/build/pytest-logs/$s.log" 2> /dev/null) (exit $rc)"
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then  # 5: every test skipped or deselected
    failed=1
    tail -n 80 "$ROOT/src/build/pytest-logs/$s.log"
  fi
done
phase_end "pytest"
echo "=== debian13: phase durations"
printf '  %s\n' "${TIMES[@]}"
exit $failed
