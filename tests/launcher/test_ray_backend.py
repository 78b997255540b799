"""`splitrun launch --backend ray`: what is refused before Ray starts (bad
resources, restarts, a job no node can hold). The jobs themselves, on a real
local Ray cluster: tests/e2e/test_ray_backend_e2e.py."""

import pytest
from cluster import REPO

from splitrun.launcher.cli import main

pytest.importorskip("ray")  # skipped where Ray is not installed, as the jobs on Ray are

EXAMPLES = REPO / "examples"


def test_bad_resources_are_refused_before_ray_starts(capsys):
    code = main(["launch", "--backend", "ray", "--worker-resources", '{"GPU": -1}',
                 str(EXAMPLES / "ps_train.py")])
    assert code == 2
    assert '--worker-resources: every amount must be a number > 0; got {"GPU": -1}' in \
        capsys.readouterr().err


def test_restarts_are_refused_saying_why_and_what_to_use(capsys):
    code = main(["launch", "--backend", "ray", "--max-restarts", "1", "--checkpoint-every", "5",
                 str(EXAMPLES / "ps_train.py")])
    assert code == 2
    err = capsys.readouterr().err
    assert "not supported with --backend ray: a restart from the newest checkpoint" in err
    assert "(splitrun launch --max-restarts N --checkpoint-every K)" in err


def test_a_job_no_node_can_hold_is_refused_by_the_option_that_fixes_it():
    from splitrun.launcher.ray_cluster import RayBackendError, check_fits
    from splitrun.splitter.labels import Role

    nodes = [{"CPU": 2.0, "memory": 8e9}, {"CPU": 4.0, "GPU": 1.0}]
    check_fits(nodes, {Role.WORKER: {"CPU": 1.0}, Role.SERVER: {"CPU": 4.0}},
               {Role.WORKER: 2, Role.SERVER: 1})  # 6 CPUs: fits
    with pytest.raises(RayBackendError, match=r'^Ray can never place this job: each worker asks '
                                              r'\{"CPU": 1, "GPU": 2\} \(--worker-resources\), and '
                                              r'no node .* \{"CPU": 4, "GPU": 1\}\); ask for less '
                                              r'with --worker-resources'):
        check_fits(nodes, {Role.WORKER: {"CPU": 1.0, "GPU": 2.0}, Role.SERVER: {"CPU": 1.0}},
                   {Role.WORKER: 1, Role.SERVER: 1})
    with pytest.raises(RayBackendError, match=r'^Ray can never place this job: it asks '
                                              r'\{"CPU": 7\} in all \(2 workers x \{"CPU": 2\}, '
                                              r'1 server x \{"CPU": 3\}\), and the cluster has '
                                              r'\{"CPU": 6\}'):
        check_fits(nodes, {Role.WORKER: {"CPU": 2.0}, Role.SERVER: {"CPU": 3.0}},
                   {Role.WORKER: 2, Role.SERVER: 1})
