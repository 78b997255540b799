"""A parameter server holds one copy of its own state: it makes only its own
parameters and optimizer state, frees the model's tensors (a process of its
own), and puts each new value in place as the step makes it, so the old one
is freed at its last use, not at the end of the step."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitrun.runtime import LoopbackHub, ProcessRuntime
from splitrun.runtime.cluster import process_memory
from splitrun.runtime.errors import MemoryCapError
from splitrun.splitter import Cluster, Label, ParameterServerMode, capture, place, split_program

S0, S1 = Label.server(0), Label.server(1)


def ps_split():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 2))
    place(model, role="server")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = (torch.randn(4, 8), torch.randn(4, 2))
    program = capture(model, lambda m, x, y: F.mse_loss(m(x), y), optimizer, batch)
    return model, split_program(program, Cluster(1, 2), ParameterServerMode())


def test_a_server_of_its_own_process_keeps_only_its_state_and_frees_the_model():
    model, split = ps_split()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    hub = LoopbackHub(split.plan.labels)
    server = ProcessRuntime(split, S1, hub.transport(S1), free_model=True)
    own = split.plan.process(S1).state
    assert set(server.state) == set(own) and len(own) < len(split.program.initial_state)
    for key, value in server.state.items():
        expected = before.get(key)
        if expected is None:  # Adam's moments start at zero
            expected = torch.zeros_like(before[key.rsplit(".", 1)[0]])
        assert torch.equal(value, expected), key
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())


def test_a_server_sharing_its_process_leaves_the_model_alone():
    model, split = ps_split()
    hub = LoopbackHub(split.plan.labels)
    ProcessRuntime(split, S0, hub.transport(S0))
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())


def test_state_beyond_the_memory_cap_is_refused_before_it_is_made(monkeypatch):
    """Where a process's own state alone passes its memory cgroup's limit, it
    says so, naming itself, the numbers and the fix, instead of being
    OOM-killed on the way; nothing of the model is freed."""
    model, split = ps_split()
    own = split.plan.process(S1).state
    owned = sum(split.program.initial_state.nbytes(key) for key in own)
    assert owned == sum(split.program.initial_state[key].nbytes for key in own)
    monkeypatch.setattr(process_memory, "own_memory_limit", lambda: owned - 1)
    hub = LoopbackHub(split.plan.labels)
    with pytest.raises(MemoryCapError) as raised:
        ProcessRuntime(split, S1, hub.transport(S1), free_model=True)
    assert re.fullmatch(
        r"\[server 1\] the parameters and optimizer state it owns need [\d.]+ MiB \(\d+ "
        r"tensors; the largest '\S+' [\d.]+ MiB, .*\) but its memory cgroup's limit is "
        r"[\d.]+ MiB: it cannot hold them; give it more memory, or spread the parameters "
        r"over more servers .*", str(raised.value)), str(raised.value)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    monkeypatch.setattr(process_memory, "own_memory_limit", lambda: owned)
    ProcessRuntime(split, S1, hub.transport(S1), free_model=True)  # exactly fits: runs
