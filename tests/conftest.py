"""Shared test setup. Helper modules (tests/, tests/scripts/) and the examples'
models (examples/) are importable through `pythonpath` in setup.cfg.

Launched jobs are compared with references computed in this process bit for
bit, and a different intra-op thread count sums in a different order. The
launcher takes a user's OMP_NUM_THREADS as its thread budget, so setting it
to this process's count makes every child compute as this process does.
For the same reason launched jobs run on the CPU (SPLITRUN_DEVICE, the
launcher's default device) also where a GPU is; the tests of the CUDA path
(test_cuda.py) ask for `--device cuda`.
"""

import os
import tempfile

import pytest
import torch
from cluster import SCRIPTS, LocalCluster
from scheduling import LongestFirstScheduling, UnitsFile, recorder_from_env, unit_of

os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
os.environ.setdefault("SPLITRUN_DEVICE", "cpu")
UNITS_DIR = pytest.StashKey[tempfile.TemporaryDirectory]()

# `make test` runs the tests in several pytest-xdist workers (tests/run_suites.py,
# --dist loadgroup, tests/scheduling.py's longest-first scheduler). A fixture that
# launches a job once for several tests (session or module scope) would be
# launched once per worker its tests land in; the tests that use it share a
# group, so one worker runs them all and it is launched once. Tests that must not
# overlap (a Ray cluster each, a gigabyte each) say so with their own xdist_group
# mark. Every other in-process test is grouped with its file (module fixtures
# made once), every other end-to-end test is a unit of its own.
SHARED_LAUNCH_GROUPS = {
    "uninterrupted_ps_job": "ps_checkpoints",
    "parallel_saved_at_five": "ps_checkpoints",
    "ps_saved_at_ten": "ps_checkpoints",
    "launched_reference": "identity",
}


def pytest_configure(config):
    recorder = recorder_from_env()
    if recorder is not None:
        config.pluginmanager.register(recorder, "splitrun-durations")
    if config.getoption("dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        config.stash[UNITS_DIR] = tempfile.TemporaryDirectory(prefix="splitrun-test-units-")


def pytest_unconfigure(config):
    folder = config.stash.get(UNITS_DIR, None)
    if folder is not None:
        folder.cleanup()


def pytest_configure_node(node):  # pytest-xdist, in the controller: one per worker
    folder = node.config.stash.get(UNITS_DIR, None)
    if folder is not None:
        node.workerinput[UnitsFile.KEY] = folder.name


def pytest_xdist_make_scheduler(config, log):
    folder = config.stash.get(UNITS_DIR, None)
    if folder is None:
        return None
    return LongestFirstScheduling(config, log, UnitsFile(folder.name))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    units = {}
    for item in items:
        groups = {SHARED_LAUNCH_GROUPS[name] for name in item.fixturenames
                  if name in SHARED_LAUNCH_GROUPS}
        groups |= {mark.args[0] for mark in item.iter_markers("xdist_group")}
        assert len(groups) <= 1, f"{item.nodeid} is in several xdist groups: {sorted(groups)}"
        units[item.nodeid] = unit_of(item.nodeid, groups.pop() if groups else None,
                                     end_to_end=item.get_closest_marker("slow") is not None)
    worker = getattr(config, "workerinput", {})
    if UnitsFile.KEY in worker:
        UnitsFile(worker[UnitsFile.KEY]).write(worker["workerid"], units)


@pytest.fixture
def local_cluster(tmp_path):
    """Starts `splitrun` processes (in the test's tmp_path) and kills, by pid,
    every one still running when the test ends, whatever its outcome."""
    cluster = LocalCluster(cwd=tmp_path)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def uninterrupted_ps_job(tmp_path_factory):
    """`uninterrupted_ps_job(kind, optimizer, steps, workers, servers)`: what worker 0
    of tests/scripts/ps_job.py, launched (real launcher, real processes) and run
    without interruption, wrote to --out. Each set of arguments is launched once
    per test session: several tests compare with the same uninterrupted job."""
    directory = tmp_path_factory.mktemp("uninterrupted_ps_job")
    cluster = LocalCluster(cwd=directory)
    outs = {}

    def run(kind="dense", optimizer="adam", steps=20, workers=2, servers=2):
        key = (kind, optimizer, steps, workers, servers)
        if key not in outs:
            out = directory / f"run{len(outs)}.pt"
            cluster.run(SCRIPTS / "ps_job.py", "--kind", kind, "--optimizer", optimizer,
                        "--steps", steps, "--out", out, workers=workers, servers=servers)
            outs[key] = out
        return torch.load(outs[key])  # a fresh copy for each test

    try:
        yield run
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def parallel_saved_at_five(tmp_path_factory):
    """(a .pt file, a sharded directory): tests/scripts/parallel_job.py launched on
    4 workers for 5 steps and saved at the end in both checkpoint formats; once per
    test session, for the plain and the sharded resume tests."""
    directory = tmp_path_factory.mktemp("parallel_saved_at_five")
    plain, sharded = directory / "ckpt.pt", directory / "ckpt"
    cluster = LocalCluster(cwd=directory)
    try:
        cluster.run(SCRIPTS / "parallel_job.py", "--steps", 5, "--save", plain, "--save",
                    sharded, workers=4)
    finally:
        cluster.close()
    return plain, sharded
