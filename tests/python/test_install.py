"""pip install from the source tree: the installed package imports without PYTHONPATH and
its `collserve launch` finds its own server binaries.

The install reuses the CMake build under test ($COLLSERVE_BUILD_DIR), so setup.py's CMake
step is an up-to-date check; pip runs offline (--no-build-isolation, --no-index) in a venv
that sees Debian's numpy and torch (--system-site-packages).
"""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
BUILD = os.path.abspath(os.environ.get("COLLSERVE_BUILD_DIR", os.path.join(ROOT, "build")))


def test_pip_install_from_source_tree(tmp_path):
    venv = tmp_path / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], capture_output=True,
                          text=True, timeout=120)
    if made.returncode != 0 and "ensurepip" in made.stdout + made.stderr:
        pytest.skip("python3-venv is not installed")
    assert made.returncode == 0, made.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COLLSERVE_BIN_DIR")}
    env.update(COLLSERVE_BUILD_DIR=BUILD, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-build-isolation", "--no-deps", ROOT],
                         capture_output=True, text=True, timeout=300, env=env)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import collserve; print(collserve.__file__)"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    run = subprocess.run([str(venv / "bin" / "collserve"), "launch", "--nproc_per_node", "2",
                          os.path.join(ROOT, "examples", "tutorial", "all_reduce_group.py")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(run.stdout.splitlines()) == ["[rank0]: Rank  0  has data  tensor(2.)",
                                               "[rank1]: Rank  1  has data  tensor(2.)"], run.stdout
    # collservectl is a console script on the venv's PATH (issue 40), running the bundled binary.
    ctl = subprocess.run([str(venv / "bin" / "collservectl"), "help", "health"], capture_output=True, text=True,
                         timeout=60, env=env, cwd=tmp_path)
    assert ctl.returncode == 0, ctl.stdout + ctl.stderr
    assert "Usage: collservectl [FLAGS] health" in ctl.stdout, ctl.stdout
    usage = subprocess.run([str(venv / "bin" / "collservectl")], capture_output=True, text=True, timeout=60, env=env,
                           cwd=tmp_path)
    assert usage.returncode == 2, usage.stdout + usage.stderr
    # The c10d backend, where it was built, is installed too and runs from the venv.
    if any(f.startswith("_collserve_torch") for f in os.listdir(os.path.join(BUILD, "python", "collserve"))):
        run = subprocess.run([str(venv / "bin" / "collserve"), "launch", "--nproc_per_node", "2",
                              os.path.join(ROOT, "examples", "digits_sgd.py"), "--backend", "collserve",
                              "--epochs", "1"], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "site-packages" in subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import collserve.torch as t; print(t._collserve_torch.__file__)"],
            capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path).stdout
