"""Checkpoints: the job's state as one ordinary PyTorch checkpoint.

    {"model": {name: tensor},            # model.load_state_dict(ckpt["model"])
     "optimizer": {"state": {...}, "param_groups": [...]},   # torch optimizer format
     "step": N,                          # steps trained
     "splitrun": {...}}                  # how it was made (for messages)

State is gathered from every process that owns some (servers in
parameter-server mode); a resumed job may have a different number of servers,
because the checkpoint is keyed by parameter names, not by owner.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from splitrun.splitter.labels import Label
from splitrun.splitter.program import InputKind, Program

from .errors import CheckpointError
from .transport.protocol import OUT_OF_PLAN

__all__ = ["CONTROL_CHANNEL", "SAVE", "save_channel", "final_state_channel",
           "to_checkpoint", "from_checkpoint", "write_checkpoint", "read_checkpoint"]

# Worker 0 -> a serving process, between steps: one int64 command.
CONTROL_CHANNEL = f"{OUT_OF_PLAN}ctl"
SAVE = 1


def save_channel(owner: Label) -> str:
    """The channel on which `owner` sends its state to worker 0 for a save."""
    return f"{OUT_OF_PLAN}save:{owner}"


def final_state_channel(owner: Label) -> str:
    """The channel on which `owner` sends its final state to worker 0 at finish."""
    return f"{OUT_OF_PLAN}state:{owner}"


def to_checkpoint(program: Program, state: Mapping[str, torch.Tensor], step: int,
                  info: Mapping[str, object] | None = None) -> dict:
    keys = [spec.key for spec in program.inputs
            if spec.kind in (InputKind.PARAM, InputKind.BUFFER)]
    # Cached tables are not inputs of an embedding-cache split's program.
    keys += [key for key in program.cached_tables if key not in keys]
    model = {key: state[key].detach().cpu() for key in keys}
    groups, opt_state, index = [], {}, 0
    for group in program.param_groups:
        indices = []
        for name in group.params:
            entry = {s: state[f"{name}.{s}"].detach().cpu() for s in group.state_names}
            if group.has_step_count:
                entry["step"] = torch.tensor(float(step))
            opt_state[index] = entry
            indices.append(index)
            index += 1
        groups.append({**group.settings, "params": indices})
    return {"model": model, "optimizer": {"state": opt_state, "param_groups": groups},
            "step": step, "splitrun": dict(info or {})}


def from_checkpoint(program: Program, checkpoint: Mapping) -> tuple[dict[str, torch.Tensor], int]:
    """The program's state keys from a checkpoint, and its step."""
    try:
        model, optimizer, step = checkpoint["model"], checkpoint["optimizer"], checkpoint["step"]
    except (KeyError, TypeError):
        raise CheckpointError("not a splitrun checkpoint: expected keys 'model', 'optimizer' "
                            "and 'step'") from None
    state = dict(program.initial_state)
    missing = [s.key for s in program.inputs
               if s.kind in (InputKind.PARAM, InputKind.BUFFER) and s.key not in model]
    if missing:
        raise CheckpointError(f"the checkpoint lacks {', '.join(missing[:5])}"
                            f"{' ...' if len(missing) > 5 else ''}; was it saved from this model?")
    for spec in program.inputs:
        if spec.kind in (InputKind.PARAM, InputKind.BUFFER):
            value = model[spec.key]
            if value.shape != state[spec.key].shape:
                raise CheckpointError(f"checkpoint {spec.key!r} has shape {list(value.shape)}, "
                                    f"the model {list(state[spec.key].shape)}")
            state[spec.key] = value
    index = 0
    for group in program.param_groups:
        for name in group.params:
            entry = optimizer["state"].get(index, optimizer["state"].get(str(index), {}))
            for state_name in group.state_names:
                if state_name not in entry:
                    raise CheckpointError(f"the checkpoint has no {state_name!r} for {name!r}; "
                                        f"was it saved with the same optimizer?")
                state[f"{name}.{state_name}"] = entry[state_name]
            index += 1
    return state, int(step)


def write_checkpoint(checkpoint: dict, path: str | os.PathLike) -> None:
    """Write atomically: a crash mid-write leaves the previous checkpoint."""
    path = os.fspath(path)
    partial = f"{path}.partial"
    torch.save(checkpoint, partial)
    os.replace(partial, path)


def read_checkpoint(path: str | os.PathLike) -> dict:
    # weights_only: a checkpoint holds tensors and plain containers, nothing to execute.
    return torch.load(os.fspath(path), map_location="cpu", weights_only=True)
