"""Worker 0 receives the state of every process that owns some: for a save
to one plain file and, with `gather_state`, at finish. Each owner sends its
state on a channel of its own (`save_channel`, `final_state_channel`);
serving processes receive worker 0's commands on `CONTROL_CHANNEL`. None of
these channels is in the step's plan: `control_channels` gives their
contracts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitrun.splitter.labels import Label, Role
from splitrun.splitter.plan import SplitPlan
from splitrun.splitter.program import Program
from splitrun.splitter.splitting.graph_splitter import SplitProgram

from ..engine.process import ProcessRuntime
from ..transport.contract import ChannelContract
from ..transport.protocol import OUT_OF_PLAN, MessageKey, Transport

__all__ = ["StateGather", "control_channels", "CONTROL_CHANNEL", "SAVE", "SAVE_SHARDED",
           "sharded_save_key", "save_channel", "final_state_channel"]

# Worker 0 -> a serving process, between steps: one int64 command.
CONTROL_CHANNEL = f"{OUT_OF_PLAN}ctl"
SAVE = 1
SAVE_SHARDED = 2  # write your own part of a sharded checkpoint (`sharded/`)


def sharded_save_key(incarnation: int, number: int) -> str:
    """The scheduler key-value prefix of the job's `number`-th sharded save:
    `/dir` holds the directory (worker 0 puts it), `/<label>` each process's
    report of what it wrote."""
    return f"splitrun/save/{incarnation}/{number}"


def save_channel(owner: Label) -> str:
    """The channel on which `owner` sends its state to worker 0 for a save."""
    return f"{OUT_OF_PLAN}save:{owner}"


def final_state_channel(owner: Label) -> str:
    """The channel on which `owner` sends its final state to worker 0 at finish."""
    return f"{OUT_OF_PLAN}state:{owner}"



@dataclass(frozen=True)
class StateGather:
    """`label`'s state on its way to worker 0, or (on worker 0) every owner's
    state collected, over `transport`; `timeout_s` bounds waiting for another
    owner's state."""

    label: Label
    incarnation: int
    transport: Transport
    split: SplitProgram
    process: ProcessRuntime
    timeout_s: float

    def send(self, channel: str, step: int) -> None:
        """Send this process's state (if it owns any) to worker 0 on `channel`."""
        keys = self.process.state_keys
        if keys:
            tensors = [self.process.state[k].detach().cpu() for k in keys]
            self.transport.send(Label.worker(0), MessageKey(self.incarnation, step, channel),
                                tensors)

    def collect(self, channel_of: Callable[[Label], str], step: int
                ) -> dict[str, torch.Tensor]:
        """Worker 0: its own state and every other owner's, sent on `channel_of(owner)`."""
        state = {k: v.detach().cpu() for k, v in self.process.state.items()}
        for proc in self.split.plan.processes:
            if proc.label == self.label or not proc.state:
                continue
            key = MessageKey(self.incarnation, step, channel_of(proc.label))
            tensors = self.transport.recv(proc.label, key, self.timeout_s)
            state.update(zip(proc.state, one_dtype_per_storage(tensors)))
        return state

    def full(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The collected state keyed like the captured program (parallel mode's
        pieces put together)."""
        return self.split.artifacts.full_state(state)


def one_dtype_per_storage(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors`, where several view one received buffer in different dtypes
    (a message's float parameters and int64 buffers), with all but the first
    dtype of each buffer copied out: `torch.save` refuses "multiple tensors
    ... that view the same data as different types"."""
    first_dtype: dict[int, torch.dtype] = {}
    result = []
    for tensor in tensors:
        storage = tensor.untyped_storage().data_ptr()
        dtype = first_dtype.setdefault(storage, tensor.dtype)
        result.append(tensor if dtype == tensor.dtype else tensor.clone())
    return result


def control_channels(plan: SplitPlan, program: Program, me: Label
                     ) -> dict[str, ChannelContract]:
    """Channels outside the step's plan: worker 0 receives every owner's state
    (for saves and at finish); serving processes receive worker 0's commands."""
    channels: dict[str, ChannelContract] = {}
    if me == Label.worker(0):
        for proc in plan.processes:
            if proc.label == me or not proc.state:
                continue
            contract = ChannelContract.of_values(
                proc.label, program, [program.input_for_key(key).node for key in proc.state])
            for channel in (save_channel, final_state_channel):
                channels[channel(proc.label)] = contract
    elif me.role is Role.SERVER:
        channels[CONTROL_CHANNEL] = ChannelContract(
            Label.worker(0), ((torch.int64, ()),))
    return channels
