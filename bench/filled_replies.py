"""What filling a message in place saves: an embedding server's reply (rows
gathered from its table shards, `send_message`) sent to a worker over a
shared-memory ring, two ways, in the same run:

- ``gather_then_send``: the rows gathered into new tensors (`gather_rows`),
  then `send` copies them into the ring (what the servers did before);
- ``filled``: `Gather` items, gathered straight into the message's slot in the
  ring (`Transport.send_filled`): one copy.

The receiver (a thread of this process, as a worker's ring reader) takes each
reply, lent in place, and drops it. Measured: the sending thread's CPU time
per reply (`time.thread_time`, what a loaded machine still compares), median
over the replies, the two ways alternating. The default reply is the
`bench/embedding_cache.py --part throughput` job's per server and step
(LRU 20 %: 9.4 MB pulled a step from 2 servers, 8 tables of 128 float32).

    python bench/filled_replies.py [--rows 9140] [--tables 8] [--replies 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time

import torch

from splitrun.runtime.engine.embedding.protocol import Gather, send_message
from splitrun.runtime.engine.embedding.row_copy import gather_rows
from splitrun.runtime.transport import ChannelContract
from splitrun.runtime.transport.grpc import GrpcTransport
from splitrun.runtime.transport.keys import MessageKey
from splitrun.runtime.transport.router import RoutedTransport, TransportChoice
from splitrun.runtime.transport.shm.ring import new_job_prefix, remove_job_segments
from splitrun.runtime.transport.shm.transport import ShmSettings
from splitrun.splitter import Label

SERVER, WORKER = Label.server(0), Label.worker(0)
CHANNEL = "@emb:s0"
# Rows of each table shard (the bench job's 250 000 rows on 2 servers) and width.
SHARD_ROWS = 125_000
DIM = 128
WAYS = ["gather_then_send", "filled"]
# Bounds one reply's receive.
RECV_TIMEOUT_S = 60.0


def transports(prefix: str) -> tuple[RoutedTransport, RoutedTransport]:
    made = []
    for label, peer in ((SERVER, WORKER), (WORKER, SERVER)):
        grpc = GrpcTransport(label, token="bench", incarnation=1)
        transport = RoutedTransport(grpc, prefix=prefix, choice=TransportChoice.SHM,
                                    settings=ShmSettings())
        transport.register({CHANNEL: ChannelContract(peer, None, later_bytes=0)})
        transport.expect({})
        made.append(transport)
    addresses = {t.label: t.start() for t in made}
    for transport in made:
        transport.set_peers({label: address for label, address in addresses.items()
                             if label != transport.label})
    return made[0], made[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=9140, help="rows of one reply, all tables")
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--replies", type=int, default=200, help="replies of each way")
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    shards = [torch.randn(SHARD_ROWS, DIM, generator=generator) for _ in range(args.tables)]
    per_table = args.rows // args.tables
    prefix = new_job_prefix()
    server, worker = transports(prefix)
    cpu_ms: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for number in range(2 * args.replies):
            way = WAYS[number % 2]
            index = [torch.randint(0, SHARD_ROWS, (per_table,), generator=generator)
                     for _ in shards]
            key = MessageKey(1, number, CHANNEL)
            got: list = []
            receiver = threading.Thread(
                target=lambda key=key, got=got: got.append(
                    worker.recv(SERVER, key, RECV_TIMEOUT_S)))
            receiver.start()
            started = time.thread_time()
            if way == "filled":
                send_message(server, WORKER, key, [Gather(s, i) for s, i in zip(shards, index)])
            else:
                server.send(WORKER, key, [gather_rows(s, i) for s, i in zip(shards, index)])
            cpu_ms[way].append(1e3 * (time.thread_time() - started))
            receiver.join(RECV_TIMEOUT_S)
            if number < 2:  # both ways carry the same rows
                assert all(torch.equal(t, s[i]) for t, s, i in zip(got[0], shards, index))
            got.clear()
    finally:
        server.close()
        worker.close()
        remove_job_segments(prefix)
    medians = {way: round(statistics.median(values), 3) for way, values in cpu_ms.items()}
    print(json.dumps({
        "benchmark": "filled_replies",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_1min": os.getloadavg()[0]},
        "reply": {"rows": per_table * args.tables, "tables": args.tables, "dim": DIM,
                  "mb": round(per_table * args.tables * DIM * 4 / 1e6, 2)},
        "replies_each_way": args.replies,
        "sender_cpu_ms_median": medians,
        "filled_vs_gather_then_send": round(medians["filled"] / medians["gather_then_send"], 3),
    }, indent=2))


if __name__ == "__main__":
    main()
