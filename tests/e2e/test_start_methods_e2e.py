"""The launcher's two ways of starting a process (--start-method): forked from
a template process that imported torch once (forkserver, the default), or a
fresh interpreter (exec). Through the real launcher, a process starts, is seen
and ends the same either way: the launcher's child, leading its own session,
stdin /dev/null, its own random state, and each way of ending (an exit code,
an exception, a splitrun error, a signal, an uncaught KeyboardInterrupt,
sys.exit with a message, a clean end that leaves a thread and an exit handler
to finish) reported in the same words. Where the template cannot be used the
processes start with exec, saying why."""

import json
import re

import pytest
from cluster import JOB_TIMEOUT_S, SCRIPTS, pid_alive

from splitrun.runtime.transport.shm.copy_tunables import (
    NON_TEMPORAL_THRESHOLD_BYTES,
    NON_TEMPORAL_TUNABLE,
)

ENDINGS_JOB = SCRIPTS / "endings.py"
# What the launcher says of each start of tests/support/scripts/endings.py but the
# last, which ends cleanly (pids written as N).
CAUSES = [
    "worker 0 (pid N) exited with code 3",
    "worker 0 (pid N) exited with code 1: ValueError: boom",
    "worker 0 (pid N) exited with code 1: LabelError: label w9 is out of range: only 1 worker",
    "worker 0 (pid N) was killed by SIGKILL",
    "worker 0 (pid N) was killed by SIGINT: KeyboardInterrupt",
    "worker 0 (pid N) exited with code 1",
]
TEMPLATE = r"(?<!standing )template \(pid (\d+)\) imported torch"
STANDING = r"standing template \(pid (\d+)\) imported torch"


@pytest.mark.parametrize("method", ["forkserver", "exec", "standing"])
def test_each_start_and_ending_is_the_same_either_way(local_cluster, tmp_path, method, request,
                                                      standing_template):
    """forkserver: the launch's own template; standing: the standing template
    conftest.py started for this test process, which many launches share."""
    if method != "standing":
        request.getfixturevalue("own_template")
    served = {standing_template.VARIABLE: standing_template.socket} if method == "standing" \
        else {}
    proc = local_cluster.start("launch", "--start-method", method.replace("standing", "forkserver"),
                               "--workers", 1, "--max-restarts", len(CAUSES), ENDINGS_JOB,
                               "--dir", tmp_path, env_extra=served)
    assert proc.wait(2 * JOB_TIMEOUT_S) == 0, proc.output()
    output = proc.output()
    causes = re.findall(r"restart \d of \d from the start \(no checkpoint yet\); cause: (.*)",
                        output)
    assert [re.sub(r"pid \d+", "pid N", cause) for cause in causes] == CAUSES, output
    assert "[worker 0] bye" in output  # sys.exit's message
    assert "[worker 0] last words" in output  # a last line without a newline
    assert re.search(r"the 1 process finished in", proc.lines[-1]), output
    # The clean end waited for the script's thread and ran its exit handler.
    assert (tmp_path / "thread-done").exists() and (tmp_path / "atexit-done").exists()
    starts = [json.loads((tmp_path / f"facts-{k}.json").read_text())
              for k in range(len(CAUSES) + 1)]
    parent = standing_template.pid if method == "standing" else proc.process.pid
    for facts in starts:
        assert facts["ppid"] == parent, "the launcher's own child, or the standing template's"
        assert facts["pgid"] == facts["sid"] == facts["pid"], "its own session and group"
        assert facts["stdin"] == ""
        assert facts["cwd"] == str(tmp_path)
        assert facts["argv"] == [str(ENDINGS_JOB), "--dir", str(tmp_path)]
        assert facts["name"] == "__main__" and facts["path0"] == str(SCRIPTS)
        assert facts["role"] == "worker"
        # Large copies (shared-memory messages) bypass the caches: glibc reads
        # this at the process's start, so the launcher sets it.
        assert f"{NON_TEMPORAL_TUNABLE}={NON_TEMPORAL_THRESHOLD_BYTES:#x}" in \
            facts["glibc_tunables"].split(":"), facts["glibc_tunables"]
        assert not pid_alive(facts["pid"])
        # What `ps` shows: the template's command line for a forked process.
        module = {"forkserver": "template", "exec": "bootstrap",
                  "standing": "standing_template"}[method]
        assert facts["cmdline"][1:3] == ["-m", f"splitrun.launcher.{module}"], facts
    for generator in ("numpy", "random"):
        assert len({facts[generator] for facts in starts}) == len(starts), \
            f"{generator}'s random state is shared between processes"
    template = re.search(TEMPLATE, output)
    assert (template is not None) == (method == "forkserver"), output
    if template is not None:
        assert not pid_alive(int(template.group(1))), "the template outlived the launcher"
    standing = re.search(STANDING, output)
    assert (standing is not None) == (method == "standing"), output
    if standing is not None:
        assert int(standing.group(1)) == standing_template.pid


@pytest.mark.parametrize("preload, why", [
    ("starts_a_thread", "the template cannot fork: it runs 2 threads"),
    ("no_such_module", "the template could not import no_such_module: ModuleNotFoundError"),
])
def test_where_the_template_cannot_fork_processes_start_with_exec(local_cluster, tmp_path,
                                                                  preload, why):
    proc = local_cluster.start("launch", "--preload", preload, "--workers", 2,
                               ENDINGS_JOB, "--dir", tmp_path, "--ending", "clean")
    assert proc.wait(JOB_TIMEOUT_S) == 0, proc.output()
    assert f"processes start with exec (slower): {why}" in proc.output(), proc.output()
    for rank in range(2):
        facts = json.loads((tmp_path / f"facts-worker{rank}.json").read_text())
        assert facts["cmdline"][1:3] == ["-m", "splitrun.launcher.bootstrap"], facts
        assert facts["ppid"] == proc.process.pid
