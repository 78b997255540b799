"""A running job's checkpoints: `Trainer.save` to one plain file (gathered on
worker 0) or to a sharded directory (every process writes what it owns and
reports it through the scheduler's key-value store), the periodic saves of
`splitrun launch --checkpoint-every`, the serving processes' part in both,
and the state a process resumes from."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from splitrun.splitter.labels import Label, Role
from splitrun.splitter.program import Program
from splitrun.splitter.splitting.graph_splitter import SplitProgram

from ..cluster.protocol import Membership
from ..engine.embedding.store import LiveSnapshot, ShardSnapshot
from ..errors import CheckpointError, SplitrunError
from ..transport.protocol import MessageKey
from . import periodic, plain, sharded
from .gather import (
    CONTROL_CHANNEL,
    SAVE,
    SAVE_SHARDED,
    StateGather,
    save_channel,
    sharded_save_key,
)

__all__ = ["Checkpointer", "resume_state"]

logger = logging.getLogger(__name__)


class Checkpointer:
    """Saves the job `gather.label` runs in: worker 0 leads every save; the
    other workers save at the same point of their loops; serving processes
    `answer` worker 0's commands between steps. `source`: the captured program
    (the checkpoint's keys); `client`: the membership, whose key-value store
    carries the reports of a sharded save; `every` and `directory`: the
    periodic saves of `splitrun launch --checkpoint-every`."""

    def __init__(self, gather: StateGather, source: Program, *,
                 client: Membership | None = None, every: int | None = None,
                 directory: str | None = None) -> None:
        self.label = gather.label
        self.split = gather.split
        self.process = gather.process
        self.source = source
        self.client = client
        self.every = every
        self.directory = directory
        self._gather = gather
        self._num_sharded_saves = 0
        if self.label.role is Role.SERVER:
            self.process.set_row_writer(self._write_rows)

    @property
    def _is_driver(self) -> bool:
        return self.label == Label.worker(0)

    def save(self, path: str | os.PathLike, step: int) -> None:
        """A worker's save after `step` steps: `path` ending in .pt or .pth, one
        plain file gathered on worker 0; any other path, a sharded directory."""
        if sharded.is_directory_path(path):
            self._save_sharded(os.fspath(path), step)
        else:
            self._save_plain(path, step)

    def save_periodically(self, step: int) -> None:
        """Under `splitrun launch --checkpoint-every K`: save every K steps into
        a sharded directory (every worker reaches the same step, so they save
        together) and keep the newest few; a restarted job resumes from the
        newest complete one (`periodic`)."""
        every, directory = self.every, self.directory
        if not every or not directory or step % every:
            return
        self.save(periodic.periodic_path(directory, step), step)
        if self._is_driver:
            periodic.prune_periodic(directory)

    def answer(self, sender: Label, tensors: Sequence[torch.Tensor], step: int) -> None:
        """A serving process, between steps: worker 0 asks for a checkpoint."""
        command = int(tensors[0]) if tensors else None
        if command == SAVE_SHARDED:
            key = self._next_sharded_key()
            directory = self.client.kv_get(f"{key}/dir", self._gather.timeout_s).decode()
            self.client.kv_put(f"{key}/{self.label}", self._write_own(directory))
            return
        if command != SAVE:
            raise SplitrunError(f"unknown control command {command} from {sender.describe()}")
        self._gather.send(save_channel(self.label), step)

    # -- one plain file --

    def _save_plain(self, path: str | os.PathLike, step: int) -> None:
        dynamic = [t.key for t in self.split.artifacts.tables if t.settings.dynamic is not None]
        if dynamic:
            raise CheckpointError(f"save({os.fspath(path)!r}): one plain file cannot hold the "
                                  f"live rows of dynamic tables ({', '.join(dynamic)}); save "
                                  f"into a directory (any path not ending in .pt or .pth)")
        if not self._is_driver:
            self._gather.send(save_channel(self.label), step)
            return
        self._command_servers(SAVE, step)
        state = self._gather.collect(save_channel, step)
        state.update(self.process.dump_tables(step))  # dirty rows go back, then the tables
        plain.write_checkpoint(
            plain.to_checkpoint(self.source, self._gather.full(state), step, self._info()),
            path)
        logger.info("[%s] checkpoint of step %d written to %s", self.label.describe(), step,
                    path)

    # -- a sharded directory --

    def _save_sharded(self, directory: str, step: int) -> None:
        """Every process that owns state writes it into `directory` and reports
        what it wrote through the scheduler's key-value store; worker 0 writes
        the metadata once every report is in."""
        client = self.client
        key = self._next_sharded_key()
        if not self._is_driver:
            if self._written_keys(self.label):
                client.kv_put(f"{key}/{self.label}", self._write_own(directory))
            return
        sharded.start_checkpoint(directory)
        client.kv_put(f"{key}/dir", directory.encode())
        self._command_servers(SAVE_SHARDED, step)
        reports = {f"{server}-rows": report
                   for server, report in self.process.save_rows(directory, step).items()}
        objects, counts = sharded.driver_objects(self.source, step, self._info())
        reports[str(self.label)] = self._write_own(directory, counts, objects)
        for label in self._other_owners():
            reports[str(label)] = client.kv_get(f"{key}/{label}", self._gather.timeout_s)
        sharded.finish_checkpoint(directory, reports)
        logger.info("[%s] sharded checkpoint of step %d written to %s (%d processes wrote)",
                    self.label.describe(), step, directory, len(reports))

    def _next_sharded_key(self) -> str:
        """Every process counts its sharded saves, so all agree on the key."""
        key = sharded_save_key(self._gather.incarnation, self._num_sharded_saves)
        self._num_sharded_saves += 1
        return key

    def _written_keys(self, label: Label) -> set[str]:
        """The state keys `label` writes into a sharded checkpoint: those it
        holds first in plan order (a state replicated on every worker, dense
        parameters kept on the workers, is written once, by worker 0)."""
        first_holder: dict[str, Label] = {}
        for proc in self.split.plan.processes:
            for key in proc.state:
                first_holder.setdefault(key, proc.label)
        return {key for key, holder in first_holder.items() if holder == label}

    def _write_own(self, directory: str, extra=(), objects=None) -> bytes:
        written = self._written_keys(self.label)
        pieces = sharded.owned_pieces(
            self.source, self.split.artifacts,
            {k: v for k, v in self.process.state.items() if k in written})
        return sharded.write_pieces(directory, str(self.label), [*extra, *pieces], objects)

    def _write_rows(self, directory: str, step: int,
                    shards: list[ShardSnapshot | LiveSnapshot]) -> bytes:
        """A server's rows of the cached tables (its embedding store calls this
        when worker 0 asks)."""
        return sharded.write_pieces(directory, f"{self.label}-rows",
                                    sharded.row_pieces(self.source, shards))

    # -- worker 0 --

    def _other_owners(self) -> list[Label]:
        return [proc.label for proc in self.split.plan.processes
                if proc.label != self.label and self._written_keys(proc.label)]

    def _command_servers(self, command: int, step: int) -> None:
        """Worker 0: tell every server that owns state to save (servers wait in
        a step's first receive; workers save at the same point of their loop)."""
        message = [torch.tensor(command, dtype=torch.int64)]
        gather = self._gather
        for label in self._other_owners():
            if label.role is Role.SERVER:
                gather.transport.send(label, MessageKey(gather.incarnation, step,
                                                        CONTROL_CHANNEL), message)

    def _info(self) -> dict[str, str]:
        plan = self.split.plan
        return {"cluster": str(plan.cluster), "plan": plan.fingerprint}


def resume_state(program: Program, split: SplitProgram, label: Label,
                 path: str | os.PathLike | None) -> tuple[dict[str, torch.Tensor], int]:
    """The state `label` starts from and the step it continues at: the
    program's initial state at step 0 without `path`; else the checkpoint's,
    from a sharded directory (only this process's part is read) or a file."""
    if path is None:
        return program.initial_state, 0
    if os.path.isdir(path):
        state, first_step = sharded.load_for(program, split, label, path)
    else:
        state, first_step = plain.load_checkpoint(program, path)
    logger.info("[%s] resuming from %s at step %d", label.describe(), path, first_step)
    return state, first_step
