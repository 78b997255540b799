"""The trainer: runs this process's share of the split step. Workers loop
over their batches (`step`, `run`), save the job together (`save`) and end
with `finish`; a server's `finish` serves steps until the workers are done."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from splitrun.splitter.labels import Label
from splitrun.splitter.ops.cache import CachedTable
from splitrun.splitter.plan import ModeKind, SplitPlan
from splitrun.splitter.program import BatchInput, Program
from splitrun.splitter.splitting.graph_splitter import SplitProgram

from ..checkpoints.gather import (
    CONTROL_CHANNEL,
    StateGather,
    control_channels,
    final_state_channel,
)
from ..checkpoints.saving import Checkpointer
from ..checkpoints.sharded import (
    LiveTable,
    ShardedCheckpoint,
    ShardedTable,
    is_directory_path,
    live_row_count,
    state_paths,
)
from ..cluster.rendezvous import Rendezvous
from ..engine.process import ProcessRuntime
from ..errors import JobFinished, PeerDied, PeerFailed, SplitrunError, TransportError
from ..transport.contract import receive_contracts
from .data import ShardedSource, shard_batch, shard_batches
from .member import JobMember
from .metrics import StepMetrics
from .progress import Progress

__all__ = ["Trainer", "start_trainer"]

logger = logging.getLogger(__name__)


class Trainer:
    """Runs this process's share of the split step."""

    def __init__(self, job: JobMember, split: SplitProgram, process: ProcessRuntime, *,
                 gather_state: bool, num_steps: int | None, first_step: int = 0,
                 source: Program | None = None,
                 on_outputs: Callable[[int, dict[str, torch.Tensor]], None] | None = None
                 ) -> None:
        self.job = job
        # Sees every step's outputs delivered to this process, a server's too.
        self._on_outputs = on_outputs
        self.split = split
        self.source = source or split.program  # the captured program: checkpoints' keys
        self.process = process
        self.gather_state = gather_state
        self.steps_done = first_step
        self.final_state: dict[str, torch.Tensor] | None = None
        self._progress = Progress(num_steps, enabled=job.is_driver)
        self._metrics = (StepMetrics(job.settings.metrics_dir, job.label)
                         if job.settings.metrics_dir else None)
        self._finished = False
        settings = job.settings
        self._gather = StateGather(job.label, job.incarnation, job.transport, split, process,
                                   settings.finish_timeout_s)
        self._checkpointer = Checkpointer(self._gather, self.source, client=job.client,
                                          every=settings.checkpoint_every,
                                          directory=settings.checkpoint_dir)

    @property
    def plan(self) -> SplitPlan:
        return self.split.plan

    @property
    def program(self) -> Program:
        """The program this process runs (the mode's rewrite of the captured one)."""
        return self.split.program

    @property
    def stats(self):
        return self.process.stats

    @property
    def cache_counters(self) -> dict[str, dict]:
        """Embedding-cache mode: per table, lookups, unique ids, hits, misses,
        evictions and bytes pulled and pushed (totals and the last step's)."""
        return self.process.cache_counters

    def run(self, batches):
        """Step through `batches`, yielding each step's outputs; each step also
        gets the next batch, so an embedding cache prefetches its rows. A
        step's hyperparameters are read before the next batch is taken, so a
        learning-rate schedule stepped while `batches` makes a batch applies
        from that batch's step on, as in a loop of `step`. A batch that
        cannot be made (`batches` raises) fails at its own step, after the
        step before it ran, as in a loop of `step`."""
        iterator = iter(batches)
        current = next(iterator, None)
        while current is not None:
            hparams = self.process.hparams(self.steps_done)
            try:
                following = next(iterator, None)
            except Exception:
                yield self.step(current, hparams=hparams)  # then the next step's own error
                raise
            yield self.step(current, next_batch=following, hparams=hparams)
            current = following

    def step(self, batch, next_batch=None, *, hparams=None) -> dict[str, torch.Tensor]:
        """Run one training step on this worker; returns the outputs delivered
        here (the loss, on worker 0). `next_batch` (optional) lets an embedding
        cache fetch the next step's missing rows while this one computes.
        `hparams`: the step's hyperparameters if read already (`run` does)."""
        if not self.job.is_worker:
            raise SplitrunError(
                f"[{self.job.label.describe()}] servers do not run the training loop; "
                f"call trainer.finish() on servers (it serves steps until the workers "
                f"finish), or loop over trainer.shard(batches), which is empty on servers")
        if self._finished:
            raise SplitrunError("step() after finish()")
        try:
            outputs = self.process.run_step(self.steps_done, self._feeds_of(batch),
                                            self._next_feeds_of(next_batch), hparams=hparams)
        except TransportError as exc:
            lost = self.job.scheduler_unreachable()
            if lost is None:
                self.job.report_failure(exc)
                raise
            if isinstance(exc, PeerDied):
                # A peer's death says its own cause (it may have hosted the
                # scheduler), but that peer may as well have died of the
                # scheduler's loss: the line says both, the death first.
                self.job.report_failure(exc)
                raise PeerDied(f"{exc}; the scheduler is unreachable too: {lost}",
                               peer=exc.peer) from exc
            # The scheduler's loss ended a peer first: that is the cause.
            raise PeerFailed(f"job failed: {lost} (then: {exc})") from exc
        except BaseException as exc:
            self.job.report_failure(exc)
            raise
        loss = outputs.get("loss")
        loss_value = None if loss is None else loss.item()
        self._step_done(outputs, loss_value)
        self._checkpointer.save_periodically(self.steps_done)
        hit_rate = self.process.cache_hit_rate()
        extra = "" if hit_rate is None else f"hit rate {hit_rate:.3f}"
        self._progress.update(self.steps_done - 1, loss_value, extra)
        return outputs

    def _step_done(self, outputs: dict[str, torch.Tensor], loss: float | None) -> None:
        """What follows every step this process ran, a worker's or a server's:
        its outputs seen, the step counted and reported (the scheduler's
        heartbeat, the launcher's step file), its metrics written."""
        if self._on_outputs is not None:
            self._on_outputs(self.steps_done, outputs)
        self.steps_done += 1
        self.job.report_progress(self.steps_done)
        if self._metrics is not None:
            self._metrics.record(self.steps_done - 1, loss=loss, stats=self.process.stats,
                                 cache_counters=self.cache_counters)

    def shard(self, batches):
        """The batches this process trains on: in parameter-server mode worker
        r of W gets rows [r*B/W, (r+1)*B/W) of every global batch; in general
        mode every worker gets whole batches; servers get none. A program
        whose loss converts its own batches (`TorchRecInput.loss`) cuts and
        converts TorchRec's batches its way."""
        if not self.job.is_worker:
            return iter(())
        whole = self.plan.mode in (ModeKind.GENERAL, ModeKind.PARALLEL)
        converter = self.source.batch_input
        if converter is not None and not isinstance(batches, ShardedSource):
            rank, num_workers = (0, 1) if whole else (self.job.rank,
                                                      self.job.cluster.num_workers)
            return _converted_shards(batches, converter, rank, num_workers)
        if whole:
            return iter(batches)
        return shard_batches(batches, self.job.rank, self.job.cluster.num_workers)

    def _feeds_of(self, batch) -> dict[str, torch.Tensor]:
        """A batch as feeds; one the program's converter takes (a TorchRec
        batch) converted first."""
        converter = self.source.batch_input
        if converter is not None and not _is_tensors(batch):
            batch = converter.convert(batch)
        return _feeds_of(batch)

    def _next_feeds_of(self, batch) -> dict[str, torch.Tensor] | None:
        """The next step's feeds, to prefetch for; None where there is no next
        batch or it is no batch (it is refused at its own step)."""
        if batch is None:
            return None
        try:
            return self._feeds_of(batch)
        except SplitrunError:
            return None

    def save(self, path: str | os.PathLike) -> None:
        """Write a checkpoint of the whole job's state after the steps done so
        far. Every worker calls it at the same point of its loop; servers answer
        between steps. (Servers, which have no loop, must not call it.)

        `path` ending in .pt or .pth: one plain file, gathered on worker 0.
        Any other path: a sharded `torch.distributed.checkpoint` directory in
        which every process writes what it owns, on its own machine
        (`checkpoints/sharded/`)."""
        if not self.job.is_worker:
            raise SplitrunError("save() is called by the workers; servers answer it between "
                                "steps (guard it with `if job.is_worker:`)")
        self._checkpointer.save(path, self.steps_done)

    # -- finishing --

    def _serve(self) -> None:
        """A server's loop: run steps as their messages come, until the workers
        finish (a receive for a step they never ran ends with JobFinished);
        between steps it answers worker 0's checkpoint commands."""
        settings = self.job.settings
        if self.plan.process(self.job.label).is_idle:
            if self.process.has_store:  # rows on the servers, everything else on workers
                try:
                    self.process.serve_rows(idle_timeout_s=settings.idle_timeout_s)
                except JobFinished:
                    return
                except BaseException as exc:
                    self.job.report_failure(exc)
                    raise
            return
        control = (CONTROL_CHANNEL, self._on_control)
        while True:
            try:
                outputs = self.process.serve_step(self.steps_done,
                                                  first_recv_timeout_s=settings.idle_timeout_s,
                                                  control=control)
            except JobFinished:
                return
            except BaseException as exc:
                self.job.report_failure(exc)
                raise
            self._step_done(outputs, None)

    def _on_control(self, sender: Label, tensors: list[torch.Tensor]) -> None:
        self._checkpointer.answer(sender, tensors, self.steps_done)

    def finish(self, *, save_to: str | os.PathLike | None = None,
               gather_tables_up_to: int | None = None) -> dict[str, torch.Tensor] | None:
        """End training on this process and leave the job.

        Workers report how many steps they ran; servers serve until then. With
        `gather_state`, worker 0 then receives every process's final state and
        returns it (a dict like `program.initial_state`); other processes return
        None. Every process waits at a final barrier before closing, so no
        message is sent to a process that is gone.

        `save_to`: the workers first save the final state there, as `save`
        does (a sharded directory: every process writes what it owns).
        `gather_tables_up_to` (bytes; needs a sharded `save_to`): a cached
        table larger than this, and each of its row states, is not gathered:
        worker 0's dict holds a `ShardedTable` over `save_to` instead, which
        reads rows by id (`view[ids]`) or whole (`view.load()`), so no process
        ever holds the whole table; a dynamic table whose live rows are larger,
        a `LiveTable` (its live ids in `view.ids`). Every process passes the
        same arguments.
        """
        _check_finish_arguments(save_to, gather_tables_up_to)
        if self._finished:
            return self.final_state
        self._finished = True
        job, transport, timeout = self.job, self.job.transport, self.job.settings.finish_timeout_s
        try:
            if job.is_worker:
                if save_to is not None:
                    self._checkpointer.save(save_to, self.steps_done)
                transport.flush(timeout)
                job.client.report_finished(job.label, self.steps_done)
            else:
                self._serve()
            if self.gather_state:
                self._gather_state(save_to, gather_tables_up_to)
            transport.flush(timeout)
            job.client.barrier("finish", job.label, timeout)
            job.client.report_done(job.label)
        except BaseException as exc:
            job.report_failure(exc)
            raise
        finally:
            elapsed = self._progress.close()
            stats = self.process.stats
            logger.info("[%s] %d steps in %.2f s; sent %d B in %d messages, received %d B; "
                        "waited %.2f s in receives", job.label.describe(), self.steps_done,
                        elapsed, stats.bytes_sent, stats.messages_sent, stats.bytes_received,
                        stats.recv_wait_s)
            for table, counters in self.cache_counters.items():
                logger.info("[%s] cache %s: %s", job.label.describe(), table,
                            {k: v for k, v in counters.items() if k != "last_step"})
            if self._metrics is not None:
                self._metrics.close()
            self.process.close()
            job.close()
        return self.final_state

    def _gather_state(self, save_to: str | os.PathLike | None,
                      gather_tables_up_to: int | None) -> None:
        if self.job.is_driver:
            large = _too_large(self.split.artifacts.tables, save_to, gather_tables_up_to)
            state = self._gather.collect(final_state_channel, self.steps_done)
            state.update(self.process.dump_tables(
                self.steps_done, {table.key for table in self.split.artifacts.tables}
                - {table.key for table in large}))
            self.final_state = self._gather.full(state)
            if large:
                self.final_state.update(_views(save_to, large, self.source))
        else:
            self._gather.send(final_state_channel(self.job.label), self.steps_done)
            self.process.drain_prefetch()


def _check_finish_arguments(save_to, gather_tables_up_to) -> None:
    if gather_tables_up_to is None:
        return
    if isinstance(gather_tables_up_to, bool) or not isinstance(gather_tables_up_to, int) \
            or gather_tables_up_to < 0:
        raise SplitrunError(f"finish(gather_tables_up_to=...) is a size in bytes >= 0, got "
                            f"{gather_tables_up_to!r}")
    if save_to is None or not is_directory_path(save_to):
        raise SplitrunError(f"finish(gather_tables_up_to={gather_tables_up_to}) hands the "
                            f"larger tables back as views of a sharded checkpoint: give "
                            f"save_to=<a directory> (got {save_to!r})")


def _too_large(tables: Sequence[CachedTable], save_to: str | os.PathLike | None,
               limit: int | None) -> list[CachedTable]:
    """The tables of more than `limit` bytes (rows and row state): a dynamic
    table's live rows as the checkpoint just saved in `save_to` holds them."""
    if limit is None:
        return []
    opened = ShardedCheckpoint(save_to) if any(
        t.settings.dynamic is not None for t in tables) else None
    return [table for table in tables if table.row_bytes * (
        table.num_rows if table.settings.dynamic is None
        else live_row_count(opened, table.key)) > limit]


def _views(directory: str | os.PathLike, tables: Sequence[CachedTable], source: Program
           ) -> dict[str, ShardedTable | LiveTable]:
    """The final state's entries of `tables`, as views of the checkpoint just
    saved in `directory`: each table and each of its row states (a dynamic
    table's live rows: `LiveTable`s, the live ids in `view.ids`)."""
    opened = ShardedCheckpoint(directory)
    paths = state_paths(source)
    views = {}
    for table in tables:
        if table.settings.dynamic is not None:
            views[table.key] = LiveTable(directory, table.key, checkpoint=opened)
            views.update({f"{table.key}.{name}": LiveTable(
                directory, table.key, f"state.{name}", checkpoint=opened)
                for name in table.state_names})
            continue
        for key in (table.key, *(f"{table.key}.{name}" for name in table.state_names)):
            views[key] = ShardedTable(directory, table.key, paths[key], checkpoint=opened)
    return views


def start_trainer(job: JobMember, split: SplitProgram, *,
                  state: Mapping[str, torch.Tensor] | None, first_step: int = 0,
                  rendezvous: Rendezvous | None = None, gather_state: bool = True,
                  num_steps: int | None = None, source: Program | None = None,
                  hparams: Callable[[int], dict[str, torch.Tensor]] | None = None,
                  on_outputs: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
                  free_model: bool = False) -> Trainer:
    """Assemble `job`'s share of `split` and return its trainer: the one way a
    process is put into a job, by `Job.start` and `run_threaded` alike. The
    channels outside the plan (checkpoints, the final state) are registered
    first, the plan's messages let in last, once the process is assembled."""
    label, transport = job.label, job.transport
    transport.register(control_channels(split.plan, split.program, label))
    process = ProcessRuntime(split, label, transport, incarnation=job.incarnation,
                             device=job.device, state=state, first_step=first_step,
                             recv_timeout_s=job.settings.recv_timeout_s,
                             rendezvous=rendezvous, hparams=hparams, free_model=free_model)
    job.watch_waits(lambda: _waiting(process))  # the scheduler names a peer it waits on
    # Set up: from here on a step that does not advance can stall a peer.
    job.report_progress(first_step)
    transport.expect(receive_contracts(split.plan, split.program, label))
    return Trainer(job, split, process, gather_state=gather_state, num_steps=num_steps,
                   first_step=first_step, source=source, on_outputs=on_outputs)


def _waiting(process: ProcessRuntime) -> tuple[Label, float] | None:
    """The peer this process's step waits on, and for how long; None where it
    waits on none: between steps, or stuck inside a receive (its thread runs a
    signal handler or a callback that does not return), so that a stall check
    can name it."""
    waiting = process.executor.waiting_on
    now = time.monotonic()
    if waiting is None or waiting.is_stuck(now):
        return None
    return waiting.peer, now - waiting.since


def _converted_shards(batches, converter: BatchInput, rank: int, num_workers: int):
    """Worker `rank`'s share of every global batch: cut and converted by
    `converter` (a TorchRec batch), or sliced by rows (tensors already)."""
    for batch in batches:
        if _is_tensors(batch):
            yield shard_batch(batch, rank, num_workers)
        else:
            yield from converter.shard([batch], rank, num_workers)


def _is_tensors(batch) -> bool:
    """A batch of feeds already: a dict, a tensor, or a sequence of tensors."""
    return (isinstance(batch, (Mapping, torch.Tensor))
            or (isinstance(batch, Sequence) and all(isinstance(t, torch.Tensor) for t in batch)))


def _feeds_of(batch) -> dict[str, torch.Tensor]:
    """A batch as feeds: a dict as given, a tensor as `batch.0`, a sequence as
    `batch.0`, `batch.1`, ... (the names capture gives the batch inputs)."""
    if isinstance(batch, Mapping):
        return dict(batch)
    if isinstance(batch, torch.Tensor):
        return {"batch.0": batch}
    if isinstance(batch, Sequence) and not isinstance(batch, str | bytes):
        return {f"batch.{i}": t for i, t in enumerate(batch)}
    raise SplitrunError(
        f"step() takes the batch as a tensor, a sequence of tensors or a dict "
        f"of feeds, got {type(batch).__name__}")
