"""Checkpoints are ordinary PyTorch state: plain torch loads them and goes on
training to the same place splitrun's resume goes (tolerance 1e-6: eager torch
rounds its fused updates differently)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitrun.runtime.checkpoints.plain import (
    from_checkpoint,
    load_checkpoint,
    read_checkpoint,
    to_checkpoint,
    write_checkpoint,
)
from splitrun.runtime.errors import CheckpointError, SplitrunError
from splitrun.splitter import capture, optim


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


CASES = {
    "adam": (lambda: optim.Adam(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01, foreach=False)),
    "sgd": (lambda: optim.SGD(lr=0.1, momentum=0.9),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False)),
    "adagrad": (lambda: optim.Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1,
                                                                              foreach=False)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_pytorch_resumes_a_splitrun_checkpoint(tmp_path, name):
    functional, torch_optimizer = CASES[name]
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    generator = torch.Generator().manual_seed(3)
    data = [(torch.randn(10, 6, generator=generator),
             torch.randint(0, 3, (10,), generator=generator)) for _ in range(10)]
    feeds = lambda s: {"batch.0": data[s][0], "batch.1": data[s][1]}  # noqa: E731
    program = capture(net(), loss_fn, functional(), data[0])
    _, state = program.train_unsplit(5, feeds)
    path = tmp_path / "ckpt.pt"
    write_checkpoint(to_checkpoint(program, state, 5), path)

    # splitrun resumes...
    restored, step = from_checkpoint(program, read_checkpoint(path))
    assert step == 5
    for key, value in state.items():
        assert torch.equal(restored[key], value)
    for s in range(5, 10):
        _, restored = program.run_unsplit(restored, {**feeds(s), **program.hparams(s)})

    # ...and so does plain PyTorch, from the same file.
    checkpoint = torch.load(path, weights_only=True)
    model = net()
    model.load_state_dict(checkpoint["model"])
    optimizer = torch_optimizer(model.parameters())
    optimizer.load_state_dict(checkpoint["optimizer"])
    for s in range(5, 10):
        optimizer.zero_grad()
        loss_fn(model, *data[s]).backward()
        optimizer.step()
    for key, param in model.named_parameters():
        torch.testing.assert_close(restored[key], param.detach(), rtol=0, atol=1e-6)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    loss_fn = lambda m, x: m(x).sum()  # noqa: E731
    program = capture(net(), loss_fn, optim.Adam(lr=0.01), torch.randn(2, 6))
    other = capture(nn.Linear(6, 3), loss_fn, optim.Adam(lr=0.01), torch.randn(2, 6))
    path = tmp_path / "other.pt"
    write_checkpoint(to_checkpoint(other, other.initial_state, 0), path)
    with pytest.raises(SplitrunError, match=r"the checkpoint lacks 0.weight"):
        from_checkpoint(program, read_checkpoint(path))
    with pytest.raises(SplitrunError, match=r"not a splitrun checkpoint"):
        from_checkpoint(program, {"weights": 1})


def saved(tmp_path, mutate=None, step=3):
    """A program and its checkpoint file, after `mutate(checkpoint)` (checksum
    written over the mutated content: the file is intact, its content wrong)."""
    loss_fn = lambda m, x: m(x).sum()  # noqa: E731
    program = capture(net(), loss_fn, optim.Adam(lr=0.01), torch.randn(2, 6))
    checkpoint = to_checkpoint(program, program.initial_state, step)
    if mutate is not None:
        mutate(checkpoint)
    path = tmp_path / "ckpt.pt"
    write_checkpoint(checkpoint, path)
    return program, path


def refused(program, path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(program, path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    return message


def test_a_written_checkpoint_is_verified_and_loads(tmp_path):
    program, path = saved(tmp_path)
    state, step = load_checkpoint(program, path)
    assert step == 3 and (tmp_path / "ckpt.pt.sha256").exists()
    for key, value in program.initial_state.items():
        assert torch.equal(state[key], value)


def test_a_write_that_fails_is_one_checkpoint_error_naming_the_path(tmp_path):
    program, _ = saved(tmp_path)
    missing = tmp_path / "no-such-dir" / "ckpt.pt"
    with pytest.raises(CheckpointError, match=rf"^checkpoint {missing}: cannot write it: "
                                              rf"No such file or directory"):
        write_checkpoint(to_checkpoint(program, program.initial_state, 1), missing)


def test_flipped_bytes_in_the_middle_are_refused(tmp_path):
    program, path = saved(tmp_path)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = bytes(b ^ 0xFF for b in data[middle:middle + 4096])
    path.write_bytes(bytes(data))
    assert "is corrupt" in refused(program, path)


@pytest.mark.parametrize("content, problem", [(None, "is empty"), (b"garbage" * 100, "corrupt")])
def test_empty_or_garbage_is_refused(tmp_path, content, problem):
    program, path = saved(tmp_path)
    path.write_bytes(content or b"")
    assert problem in refused(program, path)


def test_truncated_is_refused(tmp_path):
    program, path = saved(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    assert "is corrupt" in refused(program, path)


def test_unreadable_content_with_a_matching_checksum_is_one_line(tmp_path):
    program, path = saved(tmp_path)
    path.write_bytes(path.read_bytes()[:200])
    digest = __import__("hashlib").sha256(path.read_bytes()).hexdigest()
    (tmp_path / "ckpt.pt.sha256").write_text(f"{digest}  ckpt.pt\n")
    assert "cannot be loaded" in refused(program, path)


def test_missing_checksum_is_refused(tmp_path):
    program, path = saved(tmp_path)
    (tmp_path / "ckpt.pt.sha256").unlink()
    assert "no checksum file" in refused(program, path)


def test_wrong_dtype_is_refused(tmp_path):
    def to_double(checkpoint):
        checkpoint["model"]["0.weight"] = checkpoint["model"]["0.weight"].double()
    program, path = saved(tmp_path, to_double)
    assert "'0.weight' is float64[8, 6], the model has float32[8, 6]" in refused(program, path)


def test_negative_step_is_refused(tmp_path):
    program, path = saved(tmp_path, step=-4)
    assert "step is -4" in refused(program, path)


@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_nan_values_are_refused(tmp_path, where):
    def poison(checkpoint):
        if where == "model":
            checkpoint["model"]["2.bias"][1] = float("nan")
        else:
            checkpoint["optimizer"]["state"][0]["exp_avg"][0, 0] = float("inf")
    program, path = saved(tmp_path, poison)
    assert "non-finite" in refused(program, path)


def test_another_model_is_refused_naming_the_file(tmp_path):
    loss_fn = lambda m, x: m(x).sum()  # noqa: E731
    other = capture(nn.Linear(6, 3), loss_fn, optim.Adam(lr=0.01), torch.randn(2, 6))
    program, path = saved(tmp_path)
    write_checkpoint(to_checkpoint(other, other.initial_state, 0), path)
    assert "lacks 0.weight" in refused(program, path)
