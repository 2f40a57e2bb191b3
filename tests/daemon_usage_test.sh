#!/usr/bin/env bash
# The daemons' --help lists their own flags (absl's default printed "No flags matched."),
# with repository-relative file names, not build paths; --version names the collserve
# version; out-of-range flag values exit 2 naming the flag. Usage: daemon_usage_test.sh BUILD_DIR VERSION
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
# Out-of-range values are refused at start with exit 2 and a message naming the flag.
for bad in --link_piece_bytes=100 --link_max_wait_ms=-1 --traffic_dscp=64,0,0 --bulk_nice=20; do
  set +e
  out=$(timeout 20 "$build/server/collserve-sidecar" "$bad" 2>&1)
  rc=$?
  set -e
  [ "$rc" = 2 ] || fail "collserve-sidecar $bad exited $rc, want 2: $out"
  grep -q -- "${bad%%=*}" <<<"$out" || fail "collserve-sidecar $bad: the message names no ${bad%%=*}: $out"
done
echo "daemon usage OK"
