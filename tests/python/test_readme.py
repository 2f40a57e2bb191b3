"""The README's quickstarts run as written (issue 40): every code block after a
`<!-- readme-test: run -->` line is run with bash from the repository root, one test per
block, against the build under test ($COLLSERVE_BUILD_DIR stands in for `$PWD/build`, the
tree the main job's command builds). A block that needs the c10d backend is skipped where it
was not built. The other blocks (Helm, a torch snippet) need a cluster or are fragments."""
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
BUILD = os.path.abspath(os.environ.get("COLLSERVE_BUILD_DIR", os.path.join(ROOT, "build")))
MARK = "<!-- readme-test: run -->"


def runnable_blocks():
    """(line number, commands) of each marked block: the 4-space-indented lines after it."""
    lines = open(os.path.join(ROOT, "README.md")).read().split("\n")
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        body = []
        for l in lines[i + 1:]:
            if not l.startswith("    "):
                break
            body.append(l[4:])
        blocks.append((i + 2, body))
    return blocks


BLOCKS = runnable_blocks()


def test_the_readme_marks_its_quickstarts():
    assert len(BLOCKS) >= 2, BLOCKS
    assert all(body and any("collserve launch" in c for c in body) for _, body in BLOCKS), BLOCKS


@pytest.mark.parametrize("line,body", BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_a_quickstart_runs_as_written(line, body, tmp_path):
    script = "\n".join(body).replace("$PWD/build", BUILD)
    if "--backend collserve" in script and not any(
            f.startswith("_collserve_torch") for f in os.listdir(os.path.join(BUILD, "python", "collserve"))):
        pytest.skip("the c10d backend is not built here (no torch C++ headers)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TMPDIR"] = str(tmp_path)  # the launcher's embedded daemons keep their files there
    # `python3` is the suite's Python (Debian's, with numpy and torch), whatever else PATH has.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=240, env=env)
    assert run.returncode == 0, f"README.md:{line}:\n{script}\n{run.stdout}\n{run.stderr}"
    # Each launch printed its ranks' lines ("[rank0]: ...").
    assert len(re.findall(r"^\[rank0\]: ", run.stdout, re.M)) >= 1, run.stdout
