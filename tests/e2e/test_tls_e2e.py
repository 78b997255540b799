"""Across machines, end to end: a job whose tensor service runs over TLS
trains as one without. Traffic goes to 127.0.0.1 only. (TLS on the scheduler,
binds off loopback and the token: tests/runtime/rpc/test_tls.py.)"""

import pytest
import tls_files
import torch
from cluster import JOB_TIMEOUT_S, SCRIPTS

pytestmark = pytest.mark.skipif(not tls_files.have_openssl(), reason="needs openssl")


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    return tls_files.make(directory, "job"), tls_files.make(directory, "other")


def test_a_job_over_tls_equals_one_without(local_cluster, tmp_path, certificates):
    from test_launcher_e2e import assert_same_as_unsplit

    out = tmp_path / "result.pt"
    proc = local_cluster.start("launch", "--workers", 2, *certificates[0].args(),
                               SCRIPTS / "train_job.py", "--steps", 8, "--out", out)
    assert proc.wait(JOB_TIMEOUT_S) == 0, proc.output()
    assert_same_as_unsplit(out, "mlp", "adam", 2, 8)
    assert torch.load(out)["losses"].numel() == 8
