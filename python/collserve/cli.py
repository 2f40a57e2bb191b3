"""The `collserve` command: `collserve launch ...` (see launch.py), and the `collservectl`
console script (the bundled binary)."""
import os
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


def collservectl(argv=None):
    """The `collservectl` console script: runs the collservectl binary bundled with the
    package (bin/collservectl, or $COLLSERVE_BIN_DIR's) with these arguments, in place of this
    process, so its exit status and output are the binary's (`collservectl --help`)."""
    argv = sys.argv[1:] if argv is None else argv
    from .launch import find_binary
    try:
        binary = find_binary("collservectl")
    except FileNotFoundError as e:
        print(f"collservectl: {e}", file=sys.stderr)
        return 2
    os.execv(binary, [binary] + list(argv))


if __name__ == "__main__":
    sys.exit(main())
