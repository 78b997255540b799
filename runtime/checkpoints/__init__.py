"""Checkpoints, one room: the plain file format (`plain`), sharded
`torch.distributed.checkpoint` directories (`sharded/`), the periodic saves a
restart resumes from (`periodic`), and a running job's saves between its
processes (`saving`, `gather`)."""

from __future__ import annotations

from splitrun.splitter.lazy_exports import lazy_exports

_EXPORTS = {
    "from_checkpoint": ".plain",
    "load_checkpoint": ".plain",
    "read_checkpoint": ".plain",
    "to_checkpoint": ".plain",
    "write_checkpoint": ".plain",
    "ShardedCheckpoint": ".sharded",
    "export_checkpoint": ".sharded",
    "ShardedTable": ".sharded",
    "LiveTable": ".sharded",
    "latest_checkpoint": ".periodic",
    "Checkpointer": ".saving",
    "resume_state": ".saving",
    "StateGather": ".gather",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
