# Sourced by the build scripts (test.sh, main_job.sh, sanitizers.sh, fuzz.sh): the settings
# of the compiler cache every build tree compiles through (CMake's COLLSERVE_CCACHE, Debian's
# ccache; docs/ci.md).
#   - One cache directory per machine that outlives any clone: $COLLSERVE_CCACHE_DIR, default
#     /var/cache/collserve/ccache (~/.cache/collserve/ccache when that is not writable).
#   - CCACHE_BASEDIR is the checkout, so that the absolute paths CMake passes are hashed
#     relative to it and a clone in another folder hits what an earlier clone compiled;
#     CCACHE_NOHASHDIR leaves the working directory out of the hash of -g compiles too (the
#     sanitizer trees' line tables then name the first clone's folder, nothing else).
#   - ccache_stats_log TREE: each tree counts its own hits in TREE/ccache-stats.log
#     (CCACHE_STATSLOG), read by ccache_hit_rate TREE, so trees built side by side have
#     their own rate.
# Variables already set in the environment win.
: "${COLLSERVE_CCACHE_DIR:=/var/cache/collserve/ccache}"
if ! mkdir -p "$COLLSERVE_CCACHE_DIR" 2> /dev/null || [ ! -w "$COLLSERVE_CCACHE_DIR" ]; then
  COLLSERVE_CCACHE_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/collserve/ccache
  mkdir -p "$COLLSERVE_CCACHE_DIR"
fi
export CCACHE_DIR=${CCACHE_DIR:-$COLLSERVE_CCACHE_DIR}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
# Depend mode: a miss costs the compile alone (the compiler's -MD list, not a second
# preprocessor run, tells ccache the headers), which keeps a cold cache's first build as
# fast as a build without ccache.
export CCACHE_DEPEND=${CCACHE_DEPEND:-1}
# Five trees of a few hundred MB each (compressed), with room for older commits' objects.
export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-8G}

# ccache_stats_log TREE: later compiles in this shell count into TREE/ccache-stats.log.
ccache_stats_log() {
  mkdir -p "$1"
  CCACHE_STATSLOG=$(cd "$1" && pwd)/ccache-stats.log
  export CCACHE_STATSLOG
  : > "$CCACHE_STATSLOG"
}

# ccache_hit_rate TREE: "H of N compiles from the cache (P%)" for what TREE compiled since
# its ccache_stats_log, or "no compiles" / "no ccache".
ccache_hit_rate() {
  local log=$1/ccache-stats.log
  command -v ccache > /dev/null || { echo "no ccache"; return 0; }
  [ -s "$log" ] || { echo "no compiles"; return 0; }
  # The stats log has one counter name per compile ("direct_cache_hit",
  # "preprocessed_cache_hit", "cache_miss", ...): a compile is a hit or a miss.
  awk '/^(direct|preprocessed)_cache_hit$/ {hit++} /^cache_miss$/ {miss++}
       END {n = hit + miss; if (n == 0) print "no compiles"; else printf "%d of %d compiles from the cache (%.0f%%)\n", hit, n, 100 * hit / n}' "$log"
}
