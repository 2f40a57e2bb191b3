#!/usr/bin/env bash
# Installs the build into a temporary prefix and builds a tiny consumer against it twice:
# with find_package(collserve) (CMake) and with pkg-config. Then runs both.
# Usage: install_test.sh <source dir> <build dir>
set -euo pipefail
src="$1"
build="$2"
tmp="$(mktemp -d /tmp/collserve-install-test.XXXXXX)"
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" > "$tmp/install.log"
# Only the public headers are installed.
test -f "$tmp/prefix/include/collserve/client.h"
test -f "$tmp/prefix/include/collserve/types.h"
if find "$tmp/prefix/include" -name '*.h' | grep -v '/include/collserve/'; then
  echo "install_test: headers outside include/collserve were installed" >&2
  exit 1
fi
libdir="$(dirname "$(find "$tmp/prefix" -name libcollserve_client.so | head -1)")"
# CMake package
cmake -S "$src/tests/install/consumer" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_BUILD_TYPE=Release > "$tmp/configure.log"
cmake --build "$tmp/consumer" > "$tmp/build.log"
LD_LIBRARY_PATH="$libdir" "$tmp/consumer/consumer"
# pkg-config
export PKG_CONFIG_PATH="$libdir/pkgconfig"
# shellcheck disable=SC2046
c++ -std=c++17 "$src/tests/install/consumer/main.cc" -o "$tmp/consumer_pc" $(pkg-config --cflags --libs collserve)
LD_LIBRARY_PATH="$libdir" "$tmp/consumer_pc"
echo "install_test: OK (find_package and pkg-config)"
