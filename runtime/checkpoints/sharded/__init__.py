"""Sharded checkpoints: a `torch.distributed.checkpoint` (DCP) directory in
which every process writes what it owns; nothing is gathered anywhere.

    DIR/__w0_0.distcp        worker 0's pieces (what only it holds), step, param groups
    DIR/__s1_0.distcp        server 1's parameters and optimizer state
    DIR/__s1-rows_0.distcp   the ids of server 1's rows of the cached tables
    DIR/__s1-rows.N_0.distcp those rows, one file per table and row state (each
                             made as it is written: no server holds all at once)
    DIR/.metadata            DCP's metadata, written once, by worker 0, last but one
    DIR/checksums.sha256     sha256 of every file above (`sha256sum -c` format), last

The logical content is today's plain checkpoint (`checkpoint.to_checkpoint`):
`model.<key>` tensors, `optimizer.state.<i>.<name>` tensors, `optimizer.param_groups`,
`step` and `splitrun` as DCP byte items, nested by DCP's `planner_data`. A
tensor several processes hold a part of (parallel mode's shards) is one DCP
tensor with one chunk per part.

Cached tables are row-sharded by a hash (`embedding/sharding.py`): server k
holds a contiguous range of the table *in hash order*. So they are stored in
hash order under `hashed_rows.<table>...`, each server one chunk, next to the
ids in that order (`hashed_rows.<table>.ids`). A resumed server with any
number of servers reads exactly its own contiguous range back (DCP's chunk
resharding); `export_checkpoint` puts the rows back in id order.

No process group is needed: each process runs a DCP `FileSystemWriter` on its
own items (files prefixed with its label) and reports what it wrote (offsets,
lengths, sha256) as JSON; worker 0 writes the one `.metadata` from every
report (`FileSystemWriter.finish`). Across machines each process writes on its
own machine; gather the files into one directory before a resume or export.

DCP does not checksum data, so reads verify the sha256 of `.metadata` and of
every file they read; `CheckpointError` names the file and what is wrong.

The parts: `layout` (what sits where), `write` (one process's files and its
report), `commit` (the metadata and the checksum file), `read` (a verified
directory), `resume` (one process's part back), `export` (one plain file),
`table_view` (a table's rows read by id, as `finish()` hands a large one back).
"""

from .commit import finish_checkpoint, start_checkpoint
from .export import export_checkpoint
from .layout import (
    CHECKSUMS,
    METADATA,
    Piece,
    fqn_of,
    ids_path,
    is_directory_path,
    row_paths,
    state_paths,
)
from .live_view import LiveTable, live_row_count
from .read import ShardedCheckpoint
from .resume import RowRange, load_for, load_state
from .table_view import ShardedTable
from .write import driver_objects, owned_pieces, row_pieces, write_pieces

__all__ = ["Piece", "CHECKSUMS", "METADATA", "is_directory_path", "state_paths",
           "fqn_of", "row_paths", "ids_path", "write_pieces", "finish_checkpoint",
           "ShardedCheckpoint", "export_checkpoint", "RowRange", "load_state",
           "driver_objects", "start_checkpoint", "owned_pieces", "row_pieces", "load_for",
           "ShardedTable", "LiveTable", "live_row_count"]
