"""Checkpoints: the job's state as one ordinary PyTorch checkpoint.

    {"model": {name: tensor},            # model.load_state_dict(ckpt["model"])
     "optimizer": {"state": {...}, "param_groups": [...]},   # torch optimizer format
     "step": N,                          # steps trained
     "splitrun": {...}}                  # how it was made (for messages)

State is gathered from every process that owns some (servers in
parameter-server mode); a resumed job may have a different number of servers,
because the checkpoint is keyed by parameter names, not by owner.

Integrity: next to `ckpt.pt` a `ckpt.pt.sha256` (the `sha256sum` format) holds
the file's checksum, written at save and verified at resume, so the file stays
loadable by plain `torch.load`. A resume also checks the step, and the dtype,
shape and finiteness of every tensor against the model; each problem is one
`CheckpointError` line naming the file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import torch

from splitrun.splitter.initial_state import copy_state
from splitrun.splitter.program import InputKind, Program

from ..errors import CheckpointError
from .checksums import file_sha256

__all__ = ["to_checkpoint", "from_checkpoint", "write_checkpoint", "read_checkpoint",
           "load_checkpoint", "checksum_path", "verify_checksum", "file_sha256", "writing"]

CHECKSUM_SUFFIX = ".sha256"


def to_checkpoint(program: Program, state: Mapping[str, torch.Tensor], step: int,
                  info: Mapping[str, object] | None = None) -> dict:
    # What `model.state_dict()` holds: no non-persistent buffer.
    model = {key: state[key].detach().cpu() for key in program.checkpoint_keys()}
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


def from_checkpoint(program: Program, checkpoint: Mapping, source: str = "the checkpoint"
                    ) -> tuple[dict[str, torch.Tensor], int]:
    """The program's state keys from a checkpoint, and its step. Every tensor
    must have the dtype and shape of the model's and finite values; `source`
    names the checkpoint in errors."""
    try:
        model, optimizer, step = checkpoint["model"], checkpoint["optimizer"], checkpoint["step"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{source} is not a splitrun checkpoint: expected keys 'model', "
                              f"'optimizer' and 'step'") from None
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{source}: step is {step!r}, expected a whole number >= 0")
    if not isinstance(model, Mapping):
        raise CheckpointError(f"{source}: 'model' is a {type(model).__name__}, expected a "
                              f"dict of tensors")
    state = copy_state(program.initial_state)
    saved = [s for s in program.inputs if s.kind in (InputKind.PARAM, InputKind.BUFFER)
             and s.key not in program.non_persistent_buffers]  # those the capture's own
    missing = [s.key for s in saved if s.key not in model]
    live = [key for key in missing if key in checkpoint.get("live_rows", {})]
    if live:  # an exported sharded checkpoint: a live set is no tensor of the model's shape
        raise CheckpointError(f"{source}: {', '.join(live)} is a dynamic table, whose live rows "
                              f"a plain file cannot resume; resume from the sharded directory "
                              f"it was exported from")
    if missing:
        raise CheckpointError(f"{source}: the checkpoint lacks {', '.join(missing[:5])}"
                              f"{' ...' if len(missing) > 5 else ''}; was it saved from this "
                              f"model?")
    for spec in saved:
        state[spec.key] = _checked(model[spec.key], state[spec.key], spec.key, source)
    entries = optimizer.get("state", {}) if isinstance(optimizer, Mapping) else {}
    index = 0
    for group in program.param_groups:
        for name in group.params:
            entry = entries.get(index, entries.get(str(index), {}))
            for state_name in group.state_names:
                key = f"{name}.{state_name}"
                if not isinstance(entry, Mapping) or state_name not in entry:
                    raise CheckpointError(f"{source}: the checkpoint has no {state_name!r} for "
                                          f"{name!r}; was it saved with the same optimizer?")
                state[key] = _checked(entry[state_name], state[key], key, source)
            index += 1
    return state, step


def _checked(value, expected: torch.Tensor, key: str, source: str) -> torch.Tensor:
    """`value` if it is a tensor of `expected`'s dtype and shape with finite values."""
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{source}: {key!r} is a {type(value).__name__}, expected a "
                              f"tensor")
    if value.dtype != expected.dtype or value.shape != expected.shape:
        raise CheckpointError(
            f"{source}: {key!r} is {_describe(value)}, the model has {_describe(expected)}; "
            f"was it saved from this model (and dtype)?")
    return refuse_non_finite(value, key, source)


def refuse_non_finite(value: torch.Tensor, key: str, source: str) -> torch.Tensor:
    """`value`, unless it holds nan or inf (a checkpoint of a diverged run)."""
    if (value.is_floating_point() or value.is_complex()) and not bool(
            torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise CheckpointError(f"{source}: {key!r} has {bad} non-finite values (nan or inf); "
                              f"resume from an earlier checkpoint")
    return value


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def checksum_path(path: str | os.PathLike) -> str:
    return f"{os.fspath(path)}{CHECKSUM_SUFFIX}"


@contextlib.contextmanager
def writing(where: str) -> Iterator[None]:
    """Writes inside fail as one `CheckpointError` line naming `where` (a
    missing directory, a full disk, no permission), as reads do."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc)
        on = f" ({exc.filename})" if exc.filename else ""
        raise CheckpointError(f"{where}: cannot write it: {reason}{on}") from None


def write_checkpoint(checkpoint: dict, path: str | os.PathLike) -> None:
    """Write atomically, with the checksum next to it: a crash mid-write leaves
    the previous checkpoint (or a mismatch that a resume refuses)."""
    path = os.fspath(path)
    partial = f"{path}.partial"
    with writing(f"checkpoint {path}"):
        with open(partial, "wb") as out:  # a file object: I/O errors are OSErrors
            torch.save(checkpoint, out)
        line = f"{file_sha256(partial)}  {os.path.basename(path)}\n"
        sum_partial = f"{checksum_path(path)}.partial"
        with open(sum_partial, "w") as out:
            out.write(line)
        os.replace(partial, path)
        os.replace(sum_partial, checksum_path(path))


def verify_checksum(path: str | os.PathLike) -> None:
    """Raise `CheckpointError` unless `path` is a non-empty file whose sha256
    matches its checksum file."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read it: {exc.strerror}") from None
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is empty")
    sums = checksum_path(path)
    try:
        with open(sums) as lines:
            expected = lines.read().split()[0].lower()
    except (OSError, IndexError):
        raise CheckpointError(f"checkpoint {path} has no checksum file {sums} (written by "
                              f"Trainer.save); without it its integrity cannot be checked"
                              ) from None
    actual = file_sha256(path)
    if actual != expected:
        raise CheckpointError(f"checkpoint {path} is corrupt: its sha256 is {actual[:16]}..., "
                              f"{sums} says {expected[:16]}...; the file changed after it "
                              f"was written")


def read_checkpoint(path: str | os.PathLike) -> dict:
    """Load a checkpoint after verifying its checksum; `CheckpointError` names
    the file and what is wrong with it."""
    path = os.fspath(path)
    verify_checksum(path)
    try:
        # weights_only: a checkpoint holds tensors and plain containers, nothing to execute.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one error line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path} cannot be loaded ({type(exc).__name__}: "
                              f"{reason[:200]}); it is truncated or not a PyTorch checkpoint"
                              ) from None


def load_checkpoint(program: Program, path: str | os.PathLike
                    ) -> tuple[dict[str, torch.Tensor], int]:
    """Read, verify and check a checkpoint against `program`: (state, step)."""
    return from_checkpoint(program, read_checkpoint(path), source=f"checkpoint {os.fspath(path)}")
