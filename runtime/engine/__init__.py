"""One process's share of a split step, run: the `ProcessRuntime` that
assembles it (`process`), the `Executor` that runs its subgraph step after
step (`executor`), elementwise runs in tiles (`tiles`), the allocator setting
(`allocator`), torch.distributed collectives (`collectives`,
`worker_all_reduce`) and the embedding cache (`embedding/`). The executor and
the embedding cache see only the `Transport` protocol."""

from __future__ import annotations

from splitrun.splitter.lazy_exports import lazy_exports

_EXPORTS = {
    "ChannelStats": ".executor",
    "Executor": ".executor",
    "ExecutorStats": ".executor",
    "ProcessRuntime": ".process",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
