"""The shared-memory ring between two real processes: this test process at one
end, tests/support/scripts/ring_peer.py at the other. (A 1 GiB tensor through
it: tests/e2e/test_shm_ring_e2e.py.)"""

import hashlib
import os
import pathlib
import signal
import stat
import subprocess
import sys
import threading

import pytest
import torch
from cluster import SCRIPTS, Proc, pid_alive
from ring_ends import PEER, RECV_S, START_S, attach, producer

sys.path.insert(0, str(SCRIPTS))
from ring_peer import ordered_message  # noqa: E402

from splitrun.runtime.errors import RecvTimeout
from splitrun.runtime.transport.shm.copy_tunables import (
    NON_TEMPORAL_THRESHOLD_BYTES,
    NON_TEMPORAL_TUNABLE,
    glibc_tunables_for_copies,
)
from splitrun.runtime.transport.shm.job_files import STEP_FILE_SUFFIX, job_file_path
from splitrun.runtime.transport.shm.ring import (
    SHM_DIR,
    RingClosed,
    RingError,
    RingPeerGone,
    RingReader,
    RingSettings,
    RingWriter,
    new_job_prefix,
    remove_job_segments,
    ring_paths,
)
from splitrun.runtime.transport.shm.ring_segment import GIL_FREE_COPY_BYTES, copy_bytes

SMALL_RING = 64 << 10


@pytest.fixture
def prefix():
    prefix = new_job_prefix()
    yield prefix
    left = [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]
    remove_job_segments(prefix)
    assert not left, f"files of the job left in {SHM_DIR}: {left}"


def killed(proc):
    os.kill(proc.process.pid, signal.SIGKILL)
    proc.process.wait(timeout=30)
    assert not pid_alive(proc.process.pid)


def test_messages_arrive_in_order_through_a_small_ring(prefix):
    proc = producer(prefix, SMALL_RING, "ordered", 300)
    try:
        reader = attach(prefix)
        for index in range(300):
            header, payload = reader.recv(RECV_S)
            want_header, want_payload = ordered_message(index)
            assert header == want_header
            assert payload == want_payload, f"payload of message {index} differs"
        with pytest.raises(RingClosed, match="worker 7 closed the ring after 300 messages"):
            reader.recv_header(RECV_S)
        reader.close()
        assert proc.wait(START_S) == 0, proc.output()
    finally:
        proc.kill()


def test_message_larger_than_the_ring_streams_through_it(prefix):
    nbytes = 5 << 20  # 80 times the ring
    proc = producer(prefix, SMALL_RING, "big", nbytes)
    try:
        reader = attach(prefix)
        header, size = reader.recv_header(RECV_S)
        assert (header, size) == (b"big", nbytes)
        buffer = bytearray(size)
        reader.recv_payload_into(memoryview(buffer), RECV_S)
        want = bytes(range(256)) * (nbytes // 256)
        assert hashlib.sha256(buffer).digest() == hashlib.sha256(want).digest()
        reader.close()
        assert proc.wait(START_S) == 0, proc.output()
    finally:
        proc.kill()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_go_between_device_and_pinned_ring(prefix):
    numel = 3 << 20  # 12 MiB through a 4 MiB ring
    proc = producer(prefix, 4 << 20, "cuda", numel)
    try:
        reader = attach(prefix)
        header, size = reader.recv_header(RECV_S)
        assert (header, size) == (b"cuda", (7 + numel) * 4)
        received = torch.empty(7 + numel, dtype=torch.float32, device="cuda")
        reader.recv_payload_into_tensor(received, RECV_S)
        reader.close()
        expected = torch.arange(numel, dtype=torch.float32, device="cuda") * 0.5
        assert torch.equal(received[:7], expected[:7])
        assert torch.equal(received[7:], expected)
        assert proc.wait(START_S) == 0, proc.output()
    finally:
        proc.kill()


def test_files_are_private_and_gone_once_attached(prefix):
    proc = producer(prefix, SMALL_RING, "idle", hold=True)
    try:
        ring_path, socket_path = ring_paths(prefix, "w7-s0")
        for path in (ring_path, socket_path):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        reader = attach(prefix)
        proc.wait_for("sent", START_S)  # the producer saw the attach and unlinked
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
        reader.close()
    finally:
        proc.kill()


def test_dead_producer_is_named(prefix):
    proc = producer(prefix, SMALL_RING, "ordered", 3, hold=True)
    try:
        reader = attach(prefix)
        proc.wait_for("sent", START_S)
        killed(proc)
        for index in range(3):  # what it sent before dying is still read
            assert reader.recv(RECV_S)[0] == ordered_message(index)[0]
        with pytest.raises(RingPeerGone, match=r"\[server 0\] ring from worker 7: worker 7 "
                                               r"dropped its end .* after 3 messages"):
            reader.recv_header(RECV_S)
        reader.close()
    finally:
        proc.kill()


def test_producer_dying_mid_message_is_named(prefix):
    proc = producer(prefix, SMALL_RING, "big", 10 << 20, hold=True)
    try:
        reader = attach(prefix)
        assert reader.recv_header(RECV_S)[1] == 10 << 20
        killed(proc)  # blocked on the full ring, in the middle of the payload
        with pytest.raises(RingPeerGone, match="worker 7 dropped its end of the ring in the "
                                               "middle of a message"):
            reader.recv_payload_into(memoryview(bytearray(10 << 20)), RECV_S)
        reader.close()
    finally:
        proc.kill()


def test_dead_consumer_is_named(prefix):
    writer = RingWriter(prefix, "s0-w3", owner="server 0", peer="worker 3",
                        settings=RingSettings(capacity_bytes=SMALL_RING))
    env = dict(os.environ, SPLITRUN_TEST_HOLD="1")
    proc = Proc([sys.executable, PEER, "consume", prefix, "s0-w3"], env=env)
    try:
        writer.wait_attached(START_S)
        proc.wait_for("attached", START_S)
        writer.send(b"one", [memoryview(b"x" * 100)], RECV_S)
        killed(proc)
        with pytest.raises(RingPeerGone, match=r"\[server 0\] ring to worker 3: worker 3 "
                                               r"dropped its end .* after 1 messages"):
            writer.send(b"two", [memoryview(bytes(1 << 20))], RECV_S)
        with pytest.raises(RingError, match="unusable after an earlier failure"):
            writer.send(b"three", [], RECV_S)
    finally:
        writer.close()
        proc.kill()


def test_killed_producer_before_attach_leaves_files_that_the_prefix_removes(prefix):
    proc = producer(prefix, SMALL_RING, "idle", hold=True)
    killed(proc)
    ring_path, socket_path = ring_paths(prefix, "w7-s0")
    assert os.path.exists(ring_path) and os.path.exists(socket_path)
    assert sorted(remove_job_segments(prefix)) == sorted([ring_path, socket_path])


def test_a_failing_process_leaves_the_step_files_to_the_launcher(prefix):
    # A process cleaning up after a failure removes the job's files, but not a
    # killed peer's step file: the launcher reads it after the peer died to
    # name the step it reached, and removes it when the job ends.
    ring_path, socket_path = ring_paths(prefix, "w0-w1")
    step_path = job_file_path(prefix, "worker1", STEP_FILE_SUFFIX)
    for path in (ring_path, socket_path, step_path):
        open(path, "wb").close()
    assert sorted(remove_job_segments(prefix, keep_step_files=True)) == sorted(
        [ring_path, socket_path])
    assert os.path.exists(step_path)
    assert remove_job_segments(prefix) == [step_path]


def test_receive_deadline_and_bad_names(prefix):
    writer = RingWriter(prefix, "w0-s0", owner="worker 0", peer="server 0",
                        settings=RingSettings(capacity_bytes=SMALL_RING))
    try:
        reader = RingReader.attach(prefix, "w0-s0", owner="server 0", peer="worker 0")
        writer.wait_attached(START_S)
        with pytest.raises(RecvTimeout, match="no data from worker 0 within the deadline"):
            reader.recv_header(0.05)
        # The consumer does not read: a message larger than the ring cannot go in.
        with pytest.raises(RingError, match="no room in the ring past the deadline: server 0 "
                                            "neither reads nor releases"):
            writer.send(b"big", [memoryview(bytes(2 * SMALL_RING))], 0.05)
        reader.close()
    finally:
        writer.close()
    # A flush to a consumer that reads nothing ends at its deadline, saying so.
    writer = RingWriter(prefix, "w1-s0", owner="worker 1", peer="server 0",
                        settings=RingSettings(capacity_bytes=SMALL_RING))
    try:
        reader = RingReader.attach(prefix, "w1-s0", owner="server 0", peer="worker 1")
        writer.wait_attached(START_S)
        writer.send(b"one", [memoryview(bytes(100))], RECV_S)
        with pytest.raises(RingError, match=r"server 0 has not read the last \d+ bytes within "
                                            r"0.05 s; is it stuck\?"):
            writer.wait_consumed(0.05)
        reader.close()
    finally:
        writer.close()
    with pytest.raises(RingError, match="did not appear within"):
        RingReader.attach(prefix, "w9-s9", owner="server 0", peer="worker 9", timeout_s=0.05)
    for bad in ("", "/dev/shm/", "splitrun-", "splitrun-zz-"):
        with pytest.raises(RingError, match="refusing to create or remove"):
            remove_job_segments(bad)
    with pytest.raises(RingError, match="ring name"):
        ring_paths(prefix, "../etc")


def test_tensors_of_every_kind_round_trip(prefix):
    """send_tensors / recv_payload_into_tensor keep every byte (both ends in this
    process, the consumer on a thread: the byte layout is what is checked here)."""
    tensors = [torch.randn(3, 5, dtype=torch.bfloat16), torch.tensor(True),
               torch.empty(0, 4), torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
               torch.randn(40_000, dtype=torch.float64)]  # 5 times the ring
    writer = RingWriter(prefix, "w0-s0", owner="worker 0", peer="server 0",
                        settings=RingSettings(capacity_bytes=SMALL_RING))
    reader = RingReader.attach(prefix, "w0-s0", owner="server 0", peer="worker 0")
    received, failures = [], []

    def consume():
        try:
            for tensor in tensors:
                _, size = reader.recv_header(RECV_S)
                assert size == tensor.numel() * tensor.element_size()
                out = torch.empty(tensor.shape, dtype=tensor.dtype)
                reader.recv_payload_into_tensor(out, RECV_S)
                received.append(out)
        except BaseException as exc:  # handed to the test thread
            failures.append(exc)

    consumer = threading.Thread(target=consume, daemon=True)
    try:
        writer.wait_attached(START_S)
        consumer.start()
        for tensor in tensors:
            writer.send_tensors(b"t", [tensor], RECV_S)
        consumer.join(RECV_S)
        assert not consumer.is_alive() and not failures, failures
        for got, want in zip(received, tensors, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("seen", [True, False], ids=["told", "connect-not-seen"])
def test_closing_before_the_first_send_reads_as_closed_not_dead(prefix, monkeypatch, seen):
    # The consumer has connected (it waits in the listener's backlog) when the
    # producer closes without ever sending: an orderly close, not a death.
    # Not seen: the connect lands just after the closing producer looked at its
    # backlog (CI saw this window); the listener's close resets it without a
    # CLOSED record, and only the segment's closed flag tells it from a death.
    if not seen:
        monkeypatch.setattr(RingWriter, "_tell_waiting_consumer", lambda self: None)
    writer = RingWriter(prefix, "w7-s0", owner="worker 7", peer="server 0",
                        settings=RingSettings(capacity_bytes=SMALL_RING))
    reader = attach(prefix)
    writer.close()
    with pytest.raises(RingClosed, match="worker 7 closed the ring after 0 messages"):
        reader.recv_header(RECV_S)
    reader.close()


def test_the_janitor_removes_the_prefix_once_the_watched_processes_are_gone(tmp_path, capfd):
    """The launcher's janitor (launcher/janitor.py): after its pipe closes it
    waits for every watched pid, then removes the job's files, only those,
    and says so (its launcher is gone)."""
    from splitrun.launcher.janitor import Janitor

    prefix = new_job_prefix()
    mine = [tmp_path / f"{prefix}port1.peer", tmp_path / f"{prefix}1-w0-w1.ring"]
    other = tmp_path / f"{new_job_prefix()}port1.peer"
    for path in (*mine, other):
        path.write_bytes(b"x")
    # A watched process of the job: it runs until its stdin closes.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    janitor = Janitor()
    try:
        janitor.watch(str(tmp_path), prefix, child.pid)
        janitor.close(wait=False)  # the launcher is gone, the job's process is not
        # (The janitor may not have read the end of its pipe yet; if it has, it
        # is waiting for the child now.)
        assert all(path.exists() for path in mine), "removed under a live process"
        child.stdin.close()
        child.wait(timeout=START_S)
        janitor.wait(START_S)  # it waits at most WAIT_FOR_PIDS_S for the child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    assert janitor.pid is not None and not pid_alive(janitor.pid)
    assert not any(path.exists() for path in mine)
    assert other.exists(), "another job's file was removed"
    assert f"janitor removed 2 shared-memory files of job {prefix}" in capfd.readouterr().err
    with pytest.raises(ValueError, match="not a job prefix"):
        Janitor().watch(str(tmp_path), "../etc-", 1)


def test_the_janitor_is_quiet_after_a_launcher_that_saw_its_job_end(tmp_path, capfd):
    """A launcher whose job ended closes the janitor with `wait`: the janitor
    still removes what is left (the launcher's own step files, which it removes
    itself too), but reports no leak."""
    from splitrun.launcher.janitor import Janitor

    prefix = new_job_prefix()
    step_file = tmp_path / f"{prefix}w0.step"
    step_file.write_bytes(b"x")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=START_S)
    janitor = Janitor()
    janitor.watch(str(tmp_path), prefix, child.pid)
    janitor.close(wait=True)
    assert janitor.pid is not None and not pid_alive(janitor.pid)
    assert not step_file.exists()
    assert "janitor removed" not in capfd.readouterr().err


def test_large_pieces_copy_through_torch_and_small_ones_as_views():
    # Both paths of the ring's byte copy give the same bytes; a read-only
    # source (bytes) takes the view path, which torch.frombuffer cannot write.
    for nbytes in (1, GIL_FREE_COPY_BYTES - 1, GIL_FREE_COPY_BYTES, 3 * GIL_FREE_COPY_BYTES + 5):
        data = os.urandom(nbytes)
        for source in (memoryview(bytearray(data)), memoryview(data)):
            target = bytearray(nbytes)
            copy_bytes(memoryview(target), source)
            assert target == data


def test_a_copy_between_views_of_two_sizes_is_refused():
    for nbytes in (1, GIL_FREE_COPY_BYTES):
        with pytest.raises(ValueError, match=f"copy of {nbytes + 1} bytes into {nbytes}"):
            copy_bytes(memoryview(bytearray(nbytes)), memoryview(bytearray(nbytes + 1)))


GLIBC_LOADER = pathlib.Path("/lib64/ld-linux-x86-64.so.2")


def test_large_copies_bypass_the_caches_unless_the_user_tuned_it():
    ours = f"{NON_TEMPORAL_TUNABLE}={NON_TEMPORAL_THRESHOLD_BYTES:#x}"
    assert glibc_tunables_for_copies(None) == ours
    assert glibc_tunables_for_copies("") == ours
    theirs = "glibc.malloc.arena_max=2"
    assert glibc_tunables_for_copies(theirs) == f"{theirs}:{ours}", "the user's others kept"
    own = f"{NON_TEMPORAL_TUNABLE}=0x100000"
    assert glibc_tunables_for_copies(own) == own, "the user's threshold wins"
    if not GLIBC_LOADER.exists():
        pytest.skip("no glibc loader here to ask")
    # glibc takes the string: the loader lists the threshold it would use.
    listed = subprocess.run([str(GLIBC_LOADER), "--list-tunables"], capture_output=True,
                            text=True, env={"GLIBC_TUNABLES": glibc_tunables_for_copies(theirs)},
                            check=True).stdout
    assert f"{NON_TEMPORAL_TUNABLE}: {NON_TEMPORAL_THRESHOLD_BYTES:#x} " in listed, listed
    assert "glibc.malloc.arena_max: 0x2 " in listed, listed


LEND_RING = 4 << 20
LENT = 3 << 19  # 1.5 MiB: lendable (at least 1 MiB, at most half the ring)


def pattern(seed: int, nbytes: int = LENT) -> bytes:
    return torch.full((nbytes,), seed, dtype=torch.uint8).numpy().tobytes()


class LendRing:
    """Both ends of a 4 MiB ring in this process; `send_in_background` sends
    from a thread (a send blocks while the ring is full)."""

    def __init__(self, prefix):
        self.writer = RingWriter(prefix, "w0-s0", owner="worker 0", peer="server 0",
                                 settings=RingSettings(capacity_bytes=LEND_RING))
        self.reader = RingReader.attach(prefix, "w0-s0", owner="server 0", peer="worker 0")
        self.threads = []

    def send_in_background(self, payloads):
        """`done` is set once every payload went in; `errors` holds a failure."""
        done, errors = threading.Event(), []

        def run():
            try:
                for index, payload in enumerate(payloads):
                    self.writer.send(b"m%d" % index, [memoryview(payload)], RECV_S)
            except Exception as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)
            done.set()
        self.threads.append(threading.Thread(target=run, daemon=True))
        self.threads[-1].start()
        return done, errors

    def close(self):
        self.writer.close()
        for thread in self.threads:
            thread.join(RECV_S)
        self.reader.close()


@pytest.fixture
def ring(prefix):
    ring = LendRing(prefix)
    yield ring
    ring.close()


def test_a_lent_payload_is_the_ring_itself_and_its_room_waits_for_its_release(ring):
    reader = ring.reader
    done, errors = ring.send_in_background([pattern(1), pattern(2), pattern(3)])
    assert reader.recv_header(RECV_S) == (b"m0", LENT)
    lent = reader.lend_payload(RECV_S)
    view = lent[1000:].view(torch.int32)  # a view of a view holds it too
    assert reader.holds_address(view.untyped_storage().data_ptr()) and reader.lent_bytes == LENT
    del lent
    assert reader.recv_header(RECV_S) == (b"m1", LENT)
    copy = bytearray(LENT)
    reader.recv_payload_into(memoryview(copy), RECV_S)
    assert copy == pattern(2)
    # 1.5 + 1.5 + 1.5 MiB do not fit in 4 MiB while the first is lent: the
    # third send waits for its room, and the lent bytes stay as sent.
    assert not done.wait(0.5)
    assert bytes(view.view(torch.uint8).numpy()) == pattern(1)[1000:]
    del view  # the last tensor on it: released, the producer goes on
    assert done.wait(RECV_S) and not errors
    assert reader.recv_header(RECV_S) == (b"m2", LENT)
    assert bytes(reader.lend_payload(RECV_S).numpy()) == pattern(3)
    assert reader.lent_bytes == 0 and reader.num_lent == 2


def test_a_large_payload_skips_the_rings_end_to_lie_in_one_piece(ring):
    reader = ring.reader
    # 3 MiB first (over half the ring: streamed), so 1.5 MiB more would wrap.
    done, errors = ring.send_in_background([pattern(7, 3 << 20), pattern(8)])
    header, nbytes = reader.recv_header(RECV_S)
    reader.recv_payload_into(memoryview(bytearray(nbytes)), RECV_S)
    assert reader.recv_header(RECV_S) == (b"m1", LENT)
    lent = reader.lend_payload(RECV_S)
    assert lent is not None, "the payload wrapped around the ring's end"
    assert lent.data_ptr() % 64 == 0 and bytes(lent.numpy()) == pattern(8)
    del lent
    assert done.wait(RECV_S) and not errors


def test_a_flush_waits_for_reading_not_for_lent_payloads_and_close_keeps_them(ring):
    reader, writer = ring.reader, ring.writer
    writer.send(b"m0", [memoryview(pattern(5))], RECV_S)
    received = []

    def consume():
        reader.recv_header(RECV_S)
        received.append(reader.lend_payload(RECV_S))
        with pytest.raises(RingClosed):  # waits here, answering the flush
            reader.recv_header(RECV_S)
    ring.threads.append(threading.Thread(target=consume, daemon=True))
    ring.threads[-1].start()
    # Read and kept: a flush is done (a message the consumer holds on to for
    # a while must not stall a sender's flush).
    writer.wait_consumed(RECV_S)
    assert len(received) == 1
    ring.close()
    # Closed, yet the mapping stays until the last lent tensor is gone.
    assert bytes(received[0].numpy()) == pattern(5)
    received.clear()


def test_a_full_shared_memory_directory_is_named_with_what_to_do(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a 1 MiB tmpfs needs root")
    small = tmp_path / "small-shm"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        with pytest.raises(RingError, match=r"cannot allocate \d+ bytes .* is .*small-shm "
                                            r"full\? .*SPLITRUN_SHM_RING_MB=N makes them "
                                            r"smaller, SPLITRUN_TRANSPORT=grpc uses none"):
            RingWriter(new_job_prefix(), "w0-s0", owner="worker 0", peer="server 0",
                       settings=RingSettings(capacity_bytes=4 << 20), directory=str(small))
        assert os.listdir(small) == [], "a failed ring left its files"
    finally:
        subprocess.run(["umount", str(small)], check=True)
