"""The `collserve` command: `collserve launch ...` (see launch.py)."""
import sys

USAGE = "usage: collserve launch [--nproc_per_node N] [options] script [args...]   (collserve launch --help)"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "launch":
        from . import launch
        return launch.main(argv[1:])
    print(f"collserve: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
