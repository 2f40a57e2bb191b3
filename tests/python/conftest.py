"""Fixtures every Python suite can use (the helpers themselves are in daemons.py)."""
import shutil
import tempfile

import pytest

import daemons


@pytest.fixture
def start_daemons():
    """A factory for the daemons a test starts by hand: start_daemons.coordinator(dir, *flags,
    ...) and start_daemons.sidecar(dir, coordinator_port, *flags, ...) return daemons.Daemon
    objects; every one started is stopped when the test ends, whatever happens."""
    started = []

    class Factory:
        @staticmethod
        def coordinator(directory, *flags, **kwargs):
            started.append(daemons.start_coordinator(directory, *flags, **kwargs))
            return started[-1]

        @staticmethod
        def sidecar(directory, coordinator_port, *flags, **kwargs):
            started.append(daemons.start_sidecar(directory, coordinator_port, *flags, **kwargs))
            return started[-1]

        @staticmethod
        def mpi_sidecars(directory, coordinator_port, n, *flags):
            started.append(daemons.MpiSidecars(directory, coordinator_port, n, *flags))
            return started[-1]

    yield Factory
    for d in reversed(started):
        d.stop()


@pytest.fixture
def daemon_dir():
    """A temp dir of the test's own for its daemons' port files, logs and tokens; removed after."""
    d = tempfile.mkdtemp(prefix="collserve-py-")
    yield d
    shutil.rmtree(d, ignore_errors=True)
