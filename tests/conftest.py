"""Shared test setup. Helper modules (tests/support/, tests/support/scripts/) and the examples'
models (examples/) are importable through `pythonpath` in setup.cfg.

Launched jobs are compared with references computed in this process bit for
bit, and a different intra-op thread count sums in a different order. The
launcher takes a user's OMP_NUM_THREADS as its thread budget, so setting it
to this process's count makes every child compute as this process does.
For the same reason launched jobs run on the CPU (SPLITRUN_DEVICE, the
launcher's default device) also where a GPU is; the tests of the CUDA path
(tests/e2e/test_cuda.py) ask for `--device cuda`.

MKL chooses its GEMM kernels in each process; under heavy load a process
now and then computes a few ulps apart from the others (on this project's
2-core machine about one job in 150 under load 6-12). Naming the code
branch the CPU runs anyway (MKL_CBWR, MKL's conditional numerical
reproducibility) removed most of that; one job in a later CI run still
strayed, so the branch is named STRICT (results that depend neither on the
threads MKL splits a GEMM over nor on the data's alignment) and MKL may not
pick fewer threads than asked (MKL_DYNAMIC): see
docs/architecture.md#bit-for-bit. Both are set here, before this process's
first GEMM, for this process and every job it launches.
"""

import os
import tempfile
from dataclasses import dataclass, replace

# Set before torch loads OpenMP, which reads it then. The suite runs more
# threads than cores (4 test workers, jobs of 3-5 processes of 2 threads on
# 2 cores); OpenMP threads that spin while they wait then take the cores from
# the threads with work: three such processes side by side ran a GEMM loop in
# 10-18 s, now and then over 60 s, and in 3-6 s with PASSIVE (alone: 2.0 s
# and 2.15 s). How threads wait changes no value.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from cluster import REPO, SCRIPTS, LocalCluster, StandingTemplateProc
from scheduling import LongestFirstScheduling, UnitsFile, recorder_from_env, unit_of

os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
# MKL reads it at its first call; ATen's capability names the branch MKL runs here.
if (cpu_capability := torch.backends.cpu.get_cpu_capability()) in ("AVX512", "AVX2"):
    os.environ.setdefault("MKL_CBWR", f"{cpu_capability},STRICT")
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
os.environ.setdefault("SPLITRUN_DEVICE", "cpu")
UNITS_DIR = pytest.StashKey[tempfile.TemporaryDirectory]()

# `make test` runs the tests in several pytest-xdist workers (tests/run_suites.py,
# --dist loadgroup, tests/scheduling.py's longest-first scheduler). A fixture that
# launches a job once for several tests (session or module scope) would be
# launched once per worker its tests land in; the tests that use it share a
# group, so one worker runs them all and it is launched once (so too a folder
# one test's launch fills for the others: recsys_data). Tests that must not
# overlap (a Ray cluster each, a gigabyte each) say so with their own xdist_group
# mark. Every other in-process test is grouped with its file (module fixtures
# made once), every other end-to-end test is a unit of its own.
SHARED_LAUNCH_GROUPS = {
    "uninterrupted_ps_job": "ps_checkpoints",
    "parallel_saved_at_five": "ps_checkpoints",
    "ps_saved_at_ten": "ps_checkpoints",
    "cache_saved_at_ten": "cache_checkpoints",
    "slow_worker_run": "staleness",
    "launched_reference": "identity",
    "main_job_one_epoch": "identity",
    "main_job_three_epochs": "ray",
    "recsys_data": "recsys",
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


@pytest.fixture(scope="session")
def standing_template(tmp_path_factory):
    """A standing template for this test process (each pytest-xdist worker)."""
    template = StandingTemplateProc(tmp_path_factory.mktemp("standing-template"))
    try:
        yield template
    finally:
        template.close()


@pytest.fixture(scope="session", autouse=True)
def launches_use_a_standing_template(request):
    """Every job the tests launch forks its processes from `standing_template`
    (SPLITRUN_TEMPLATE) instead of importing torch in a template of its own
    (seconds of CPU per launch). The tests of a launch's own template unset the
    variable (`own_template`). With SPLITRUN_TESTS_OWN_TEMPLATES=1, each launch
    starts its own (to compare)."""
    if os.environ.get("SPLITRUN_TESTS_OWN_TEMPLATES") == "1":
        yield
        return
    template = request.getfixturevalue("standing_template")
    os.environ[StandingTemplateProc.VARIABLE] = template.socket
    try:
        yield
    finally:
        del os.environ[StandingTemplateProc.VARIABLE]


@pytest.fixture
def own_template(monkeypatch):
    """The launches of this test start their own template, as without a standing one."""
    monkeypatch.delenv(StandingTemplateProc.VARIABLE, raising=False)


@pytest.fixture
def local_cluster(tmp_path):
    """Starts `splitrun` processes (in the test's tmp_path) and kills, by pid,
    every one still running when the test ends, whatever its outcome."""
    cluster = LocalCluster(cwd=tmp_path)
    try:
        yield cluster
    finally:
        cluster.close()


class UninterruptedPsJobs:
    """`jobs(kind, optimizer, steps, workers, servers)`: what worker 0 of
    tests/support/scripts/ps_job.py, launched (real launcher, real processes) and run
    without interruption, wrote to --out. Each set of arguments is launched once
    per test session: several tests compare with the same uninterrupted job.
    Each run also writes a checkpoint after half its steps, in both formats,
    and trains on (`saved_at_half`): the tests that resume one compare with the
    same run's end."""

    def __init__(self, directory) -> None:
        self.directory = directory
        self.cluster = LocalCluster(cwd=directory)
        self.runs: dict[tuple, dict[str, object]] = {}

    def _run(self, kind, optimizer, steps, workers, servers) -> dict[str, object]:
        key = (kind, optimizer, steps, workers, servers)
        if key not in self.runs:
            name = self.directory / f"run{len(self.runs)}"
            paths = {"out": name.with_suffix(".pt"),
                     "plain": name.parent / f"{name.name}-step{steps // 2}.pt",
                     "sharded": name.parent / f"{name.name}-step{steps // 2}"}
            self.cluster.run(SCRIPTS / "ps_job.py", "--kind", kind, "--optimizer", optimizer,
                             "--steps", steps, "--out", paths["out"], "--save-at", steps // 2,
                             "--save", paths["plain"], "--save", paths["sharded"],
                             workers=workers, servers=servers)
            self.runs[key] = paths
        return self.runs[key]

    def __call__(self, kind="dense", optimizer="adam", steps=20, workers=2, servers=2):
        return torch.load(self._run(kind, optimizer, steps, workers, servers)["out"])  # a copy

    def saved_at_half(self, kind="dense", optimizer="adam", steps=20, workers=2, servers=2):
        """(a .pt file, a sharded directory): the checkpoints the run wrote
        after step steps // 2 (and trained on to its end)."""
        paths = self._run(kind, optimizer, steps, workers, servers)
        return paths["plain"], paths["sharded"]


@pytest.fixture(scope="session")
def uninterrupted_ps_job(tmp_path_factory):
    """See UninterruptedPsJobs."""
    jobs = UninterruptedPsJobs(tmp_path_factory.mktemp("uninterrupted_ps_job"))
    try:
        yield jobs
    finally:
        jobs.cluster.close()


@pytest.fixture(scope="session")
def ps_saved_at_ten(uninterrupted_ps_job):
    """(a .pt file, a sharded directory): the dense job (Adam, 2 workers, 2
    servers, 20 steps) saved after step 10 in both formats, by the launch the
    tests compare with as the uninterrupted job (it trains on to step 20)."""
    return uninterrupted_ps_job.saved_at_half("dense", "adam", steps=20, workers=2, servers=2)


@pytest.fixture(scope="session")
def parallel_saved_at_five(tmp_path_factory):
    """(a .pt file, a sharded directory): tests/support/scripts/parallel_job.py launched on
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


@dataclass(frozen=True)
class SavedRun:
    """A launched run that saved checkpoints midway and trained on: what worker 0
    wrote to --out, the launcher's output, the checkpoints (a .pt file, a
    sharded directory)."""
    out: os.PathLike
    output: str
    plain: os.PathLike
    sharded: os.PathLike


@pytest.fixture(scope="session")
def cache_saved_at_ten(tmp_path_factory) -> SavedRun:
    """tests/support/scripts/cache_job.py (Adagrad) on 1 worker and 2 servers with a
    40-row cache for 20 steps, saved after step 10 in both formats; launched
    once per test session, for the tests of its end and of resuming its
    checkpoints (tests/e2e/test_cache_e2e.py, tests/e2e/test_sharded_checkpoint_e2e.py)."""
    directory = tmp_path_factory.mktemp("cache_saved_at_ten")
    run = SavedRun(directory / "run.pt", "", directory / "step10.pt", directory / "step10")
    cluster = LocalCluster(cwd=directory)
    try:
        proc = cluster.run(SCRIPTS / "cache_job.py", "--steps", 20, "--cache-rows", 40,
                           "--save-at", 10, "--save", run.plain, "--save", run.sharded,
                           "--out", run.out, workers=1, servers=2)
    finally:
        cluster.close()
    return replace(run, output=proc.output())


@dataclass(frozen=True)
class MainJobRun:
    """The main job launched with --log-dir and --metrics-dir: the launcher's
    output, those folders and the checkpoint it saved at its end."""
    output: str
    logs: os.PathLike
    metrics: os.PathLike
    checkpoint: os.PathLike


@pytest.fixture(scope="session")
def main_job_one_epoch(tmp_path_factory) -> MainJobRun:
    """examples/ps_train.py for one epoch on 2 workers and 1 server, through
    `splitrun -v --log-dir DIR launch --metrics-dir DIR` (the global option
    before the subcommand, the other after it), saving a checkpoint at the end:
    launched once per test session, for the tests of the log and metrics files
    (tests/e2e/test_launcher_logs_e2e.py) and as the reference the jobs started the
    srun and torchrun ways must equal (tests/e2e/test_identity_e2e.py)."""
    directory = tmp_path_factory.mktemp("main_job_one_epoch")
    run = MainJobRun("", directory / "logs", directory / "metrics", directory / "launch.pt")
    cluster = LocalCluster(cwd=directory)
    try:
        proc = cluster.start("--log-dir", run.logs, "launch", "--metrics-dir", run.metrics,
                             "--workers", 2, "--servers", 1, REPO / "examples" / "ps_train.py",
                             "--epochs", 1, "--save", run.checkpoint)
        assert proc.wait() == 0, proc.output()
    finally:
        cluster.close()
    return replace(run, output=proc.output())


@pytest.fixture(scope="session")
def main_job_three_epochs(tmp_path_factory) -> str:
    """The launcher's output of examples/ps_train.py for three epochs on 2
    workers and 1 server (`splitrun -v launch`, --min-accuracy 0.9): launched
    once per test session, for the example's test (tests/e2e/test_examples.py) and
    as the local run the Ray backend's must equal (tests/e2e/test_ray_backend_e2e.py;
    in its xdist group, so one worker launches it)."""
    directory = tmp_path_factory.mktemp("main_job_three_epochs")
    cluster = LocalCluster(cwd=directory)
    try:
        proc = cluster.run(REPO / "examples" / "ps_train.py", "--epochs", 3, "--min-accuracy",
                           0.9, workers=2, servers=1)
    finally:
        cluster.close()
    return proc.output()
