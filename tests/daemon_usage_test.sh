#!/usr/bin/env bash
# The daemons' --help lists their own flags (absl's default printed "No flags matched."),
# with repository-relative file names, not build paths; --version names the collserve
# version. Usage: daemon_usage_test.sh BUILD_DIR VERSION
set -euo pipefail
build=$1 version=$2
fail() { echo "FAIL: $*" >&2; exit 1; }
for d in coordinator sidecar; do
  bin=$build/server/collserve-$d
  help=$(timeout 20 "$bin" --help 2>&1 || true)
  grep -q "No flags matched" <<<"$help" && fail "collserve-$d --help matched no flags"
  grep -q -- "--log_level" <<<"$help" || fail "collserve-$d --help lacks --log_level: $help"
  grep -q "Flags from server/$d/main.cc" <<<"$help" || fail "collserve-$d --help names no repository path: $help"
  grep -q "$build\|/work/\|/home/" <<<"$help" && fail "collserve-$d --help shows a build path"
  out=$(timeout 20 "$bin" --version 2>&1 || true)
  [ "$out" = "collserve-$d $version" ] || fail "collserve-$d --version printed '$out', want 'collserve-$d $version'"
done
echo "daemon usage OK"
