"""Builds the collserve Python package with CMake (metadata: pyproject.toml).

build_py first runs the CMake build of the pybind11 modules (_collserve, and _collserve_torch,
the c10d backend, when torch's C++ headers are installed), the SDK library they share and the
server binaries (collserve-coordinator, collserve-sidecar, collservectl) in $COLLSERVE_BUILD_DIR (default:
build/ in the source tree, configured if it is not yet), then puts the modules and library in
the package and the binaries in its bin/, where `collserve launch` finds them.
CMAKE_BUILD_PARALLEL_LEVEL sets the build's parallelism (default 2).
"""
import glob
import os
import shutil
import subprocess
import sysconfig

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))
BINARIES = ["collserve-coordinator", "collserve-sidecar", "collservectl"]


class BinaryDistribution(Distribution):
    """The wheel holds a compiled module and binaries: tag it for this platform."""

    def has_ext_modules(self):
        return True


class CMakeBuildPy(build_py):
    def run(self):
        super().run()
        build_dir = os.path.abspath(os.environ.get("COLLSERVE_BUILD_DIR") or os.path.join(ROOT, "build"))
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            subprocess.check_call(["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release"])
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")
        targets = ["_collserve", *BINARIES]
        built_dir = os.path.join(build_dir, "python", "collserve")
        subprocess.check_call(["cmake", "--build", build_dir, "-j", jobs, "--target", *targets])
        if os.path.isdir(os.path.join(build_dir, "python", "CMakeFiles", "_collserve_torch.dir")):
            subprocess.check_call(["cmake", "--build", build_dir, "-j", jobs, "--target", "_collserve_torch"])
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        module = os.path.join(built_dir, "_collserve" + suffix)
        if not os.path.exists(module):
            built = glob.glob(os.path.join(built_dir, "_collserve*.so"))
            raise RuntimeError(f"CMake built {built or 'no module'}, but this Python needs _collserve{suffix}: "
                               "install with the Python the build uses (Debian's /usr/bin/python3)")
        package = os.path.join(self.build_lib, "collserve")
        # The modules and the SDK they share (their RPATH is $ORIGIN); the c10d backend
        # module (_collserve_torch) only where torch's C++ headers were there to build it.
        for path in [module, *glob.glob(os.path.join(built_dir, "_collserve_torch" + suffix)),
                     *glob.glob(os.path.join(built_dir, "libcollserve_client.so*"))]:
            shutil.copy2(path, package)
        os.makedirs(os.path.join(package, "bin"), exist_ok=True)
        for name in BINARIES:
            shutil.copy2(os.path.join(build_dir, "server", name), os.path.join(package, "bin", name))


setup(cmdclass={"build_py": CMakeBuildPy}, distclass=BinaryDistribution)
