#!/usr/bin/env bash
# Builds the Debian 12 (bookworm) base image of the Dockerfiles here without an image
# registry: mmdebstrap makes a minimal root (--variant=minbase: the Essential packages and
# apt) from the machine's own Debian mirror, and `docker import` / `podman import` turns
# it into an image. Where no container engine runs, it keeps the tarball and prints how
# to import it elsewhere. Then build with --build-arg DEBIAN_IMAGE=<tag> (README.md).
#
# The mirror comes from the machine's apt sources (/etc/apt/sources.list.d/*.sources,
# *.list, /etc/apt/sources.list): the first URI that is not a security mirror, plus the
# security mirror if there is one; --mirror/--security-mirror override them. The image's
# apt sources are those mirrors (the Dockerfiles run apt-get update against them).
#
# Needs mmdebstrap (apt-get install mmdebstrap) and root, or a user that may create user
# namespaces (mmdebstrap's unshare mode). Measured here: 25 s, a 170 MB tarball (bookworm).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: build_base_image.sh [options]

Builds a minimal Debian root with mmdebstrap and imports it as a container image.

  --tag TAG              image name to import as (default: collserve/debian:12)
  --suite SUITE          Debian suite (default: bookworm, i.e. Debian 12)
  --mirror URL           Debian mirror (default: from the machine's apt sources,
                         else http://deb.debian.org/debian)
  --security-mirror URL  security mirror (default: from the apt sources; "none" = none)
  --output FILE          where to write the root tarball (default: a temporary file,
                         deleted after a successful import); with --output it is kept
  --engine ENGINE        docker or podman (default: the first one whose engine answers;
                         none = only write the tarball)
  --dry-run              print the mirrors and the commands, run nothing
  -h, --help             this text

Then, from the repository root:
  podman build -f deploy/docker/coordinator.Dockerfile \
    --build-arg DEBIAN_IMAGE=collserve/debian:12 -t collserve/coordinator:0.1.0 .
EOF
}

tag=collserve/debian:12
suite=bookworm
mirror=""
security_mirror=""
output=""
engine=""
dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag=${2:?--tag needs a value}; shift 2 ;;
    --suite) suite=${2:?--suite needs a value}; shift 2 ;;
    --mirror) mirror=${2:?--mirror needs a value}; shift 2 ;;
    --security-mirror) security_mirror=${2:?--security-mirror needs a value}; shift 2 ;;
    --output) output=${2:?--output needs a value}; shift 2 ;;
    --engine) engine=${2:?--engine needs a value}; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "build_base_image: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$engine" in
  "" | docker | podman | none) ;;
  *) echo "build_base_image: --engine must be docker, podman or none" >&2; exit 2 ;;
esac

# Every URI of the machine's apt sources, one per line: deb822 (URIs: a b) and one-line
# ("deb [opts] URI suite comp...") formats.
apt_uris() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && sed -n 's/^URIs:[[:space:]]*//p' "$f" | tr -s ' \t' '\n'
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] && sed -n 's/^[[:space:]]*deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]\+\).*/\2/p' "$f"
  done
  return 0
}
uris=$(apt_uris | grep -E '^(https?|file)://' || true)
if [ -z "$mirror" ]; then
  mirror=$(grep -v security <<<"$uris" | head -n 1 || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi
if [ -z "$security_mirror" ]; then
  security_mirror=$(grep security <<<"$uris" | head -n 1 || true)
fi
mirror=${mirror%/}
security_mirror=${security_mirror%/}
# One apt source line per suite: these become the image's /etc/apt/sources.list. A
# release has -updates and -security suites; unstable has neither.
sources=("deb $mirror $suite main")
case "$suite" in
  sid | unstable | experimental) ;;
  *)
    sources+=("deb $mirror $suite-updates main")
    if [ -n "$security_mirror" ] && [ "$security_mirror" != none ]; then
      sources+=("deb $security_mirror $suite-security main")
    fi
    ;;
esac

# A container engine that answers (a docker client without a daemon does not count).
if [ -z "$engine" ]; then
  engine=none
  for candidate in docker podman; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" info >/dev/null 2>&1; then
      engine=$candidate
      break
    fi
  done
fi

keep=1
if [ -z "$output" ]; then
  output=${TMPDIR:-/tmp}/collserve-debian-$suite.tar
  [ "$engine" = none ] || keep=0
fi
debstrap=(mmdebstrap --variant=minbase "$suite" "$output" "${sources[@]}")
# Docker and podman import a root without a command; give it the shell as Debian's image does.
import=(import --change 'CMD ["bash"]' "$output" "$tag")

printf 'build_base_image: apt source: %s\n' "${sources[@]}"
if [ "$dry_run" -eq 1 ]; then
  printf 'build_base_image: would run:'; printf ' %q' "${debstrap[@]}"; echo
  if [ "$engine" = none ]; then
    echo "build_base_image: no container engine answers: would keep $output"
  else
    printf 'build_base_image: would run:'; printf ' %q' "$engine" "${import[@]}"; echo
  fi
  exit 0
fi

command -v mmdebstrap >/dev/null 2>&1 || {
  echo "build_base_image: mmdebstrap is not installed (apt-get install mmdebstrap)" >&2
  exit 1
}
mkdir -p "$(dirname "$output")"
echo "build_base_image: mmdebstrap $suite -> $output"
if ! "${debstrap[@]}"; then
  [ "$keep" -eq 1 ] || rm -f "$output"
  echo "build_base_image: mmdebstrap failed (root, or user namespaces, and the mirror are needed)" >&2
  exit 1
fi
echo "build_base_image: root tarball: $output ($(du -h "$output" | cut -f1))"

if [ "$engine" = none ]; then
  cat <<EOF
build_base_image: no container engine answers here (docker/podman info failed), so the
tarball was not imported. On a machine with one:
  docker import --change 'CMD ["bash"]' $output $tag
  podman import --change 'CMD ["bash"]' $output $tag
then build with --build-arg DEBIAN_IMAGE=$tag.
EOF
  exit 0
fi
echo "build_base_image: $engine import -> $tag"
"$engine" "${import[@]}"
[ "$keep" -eq 1 ] || rm -f "$output"
echo "build_base_image: done; build with --build-arg DEBIAN_IMAGE=$tag"
