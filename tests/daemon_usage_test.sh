#!/usr/bin/env bash
# The daemons' --help lists their own flags (absl's default printed "No flags matched."),
# with repository-relative file names, not build paths; --version names the collserve
# version; out-of-range flag values (and COLLSERVE_MUTEX_DEADLOCK_DETECTION) exit 2 naming them. Usage: daemon_usage_test.sh BUILD_DIR VERSION
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
# A COLLSERVE_MUTEX_DEADLOCK_DETECTION other than ignore/report/abort (common/mutex_mode.h) is
# refused at start the same way, naming the variable.
for d in coordinator sidecar; do
  set +e
  out=$(COLLSERVE_MUTEX_DEADLOCK_DETECTION=sometimes timeout 5 "$build/server/collserve-$d" 2>&1)
  rc=$?
  set -e
  [ "$rc" = 2 ] || fail "collserve-$d with COLLSERVE_MUTEX_DEADLOCK_DETECTION=sometimes exited $rc, want 2: $out"
  grep -q 'COLLSERVE_MUTEX_DEADLOCK_DETECTION="sometimes": use ignore' <<<"$out" ||
    fail "collserve-$d: the message does not name the variable and its values: $out"
done
echo "daemon usage OK"
