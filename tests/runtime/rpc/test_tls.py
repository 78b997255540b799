"""Across machines: TLS on the scheduler (and, end to end, on the tensor
service: tests/e2e/test_tls_e2e.py), no unencrypted bind off loopback unless
asked, and the token kept off command lines. Traffic goes to 127.0.0.1 only."""

import os
import stat

import pytest
import tls_files
from cluster import SCRIPTS

from splitrun.runtime.cluster.membership import SchedulerClient
from splitrun.runtime.cluster.scheduler import Scheduler, SchedulerSettings
from splitrun.runtime.errors import ClusterError
from splitrun.runtime.rpc.tls import TlsFiles, check_bind
from splitrun.splitter.labels import Label, Role

pytestmark = pytest.mark.skipif(not tls_files.have_openssl(), reason="needs openssl")

TOKEN = "tls-token"


def tls_of(files) -> TlsFiles:
    return TlsFiles(str(files.cert), str(files.key), str(files.ca))


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    return tls_files.make(directory, "job"), tls_files.make(directory, "other")


def test_scheduler_over_tls_takes_clients_with_the_ca_only(certificates):
    job, other = certificates
    scheduler = Scheduler(SchedulerSettings(1, 0, TOKEN, 3, dial_back_timeout_s=None))
    address = scheduler.start("127.0.0.1", 0, tls_of(job))
    try:
        client = SchedulerClient(address, TOKEN, tls_of(job))
        assert client.register(Role.WORKER, None, "127.0.0.1:1").label == Label.worker(0)
        client.close()
        for tls in (None, tls_of(other)):  # plaintext, or a CA that did not sign it
            stranger = SchedulerClient(address, TOKEN, tls)
            with pytest.raises(ClusterError, match="UNAVAILABLE"):
                stranger.kv_put("key", b"value")
            stranger.close()
    finally:
        scheduler.stop(0)


def test_an_off_loopback_bind_needs_tls_or_insecure(local_cluster, certificates):
    with pytest.raises(ClusterError, match="without TLS"):
        check_bind("10.1.2.3", None, False, "splitrun launch")
    check_bind("10.1.2.3", None, True, "splitrun launch")
    check_bind("10.1.2.3", tls_of(certificates[0]), False, "splitrun launch")
    for host in ("127.0.0.1", "localhost", "::1"):
        check_bind(host, None, False, "splitrun launch")
    proc = local_cluster.start("launch", "--host", "10.1.2.3", SCRIPTS / "train_job.py")
    assert proc.wait(120) == 2
    assert "would listen on 10.1.2.3 without TLS" in proc.output()


def test_join_refuses_a_token_file_others_can_read(local_cluster, tmp_path):
    token = tmp_path / "job.token"
    token.write_text("secret\n")
    token.chmod(0o644)
    proc = local_cluster.start("join", "--scheduler", "127.0.0.1:1", "--token-file", token,
                    SCRIPTS / "train_job.py")
    assert proc.wait(120) == 2
    assert f"chmod 600 {token}" in proc.output()


def test_scheduler_writes_its_token_to_a_private_file(local_cluster, tmp_path):
    path = tmp_path / "job.token"
    proc = local_cluster.start("scheduler", "--workers", 1, "--token-file", path)
    try:
        proc.wait_for(r"scheduler at \S+; token in", 120)
    finally:
        proc.kill()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    token = path.read_text().strip()
    assert len(token) >= 32 and token not in proc.output()
