"""A captured program's starting state is made where it is taken (`InitialState`):
capture copies nothing, a process makes only its own state, and a server of
its own process frees the model's tensors before making its optimizer state."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitrun.splitter import capture, optim
from splitrun.splitter.errors import SplitrunError
from splitrun.splitter.initial_state import Deferred, InitialState


def captured(optimizer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    batch = (torch.randn(4, 6), torch.randn(4, 2))
    program = capture(model, lambda m, x, y: F.mse_loss(m(x), y), optimizer(model), batch)
    return model, program


OPTIMIZERS = {
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1,
                                             initial_accumulator_value=0.25),
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_capture_copies_nothing_and_each_read_is_a_fresh_copy(name):
    model, program = captured(OPTIMIZERS[name])
    state = program.initial_state
    assert isinstance(state, InitialState)
    weight = model[0].weight
    first, second = state["0.weight"], state["0.weight"]
    assert torch.equal(first, weight) and torch.equal(second, weight)
    pointers = {first.data_ptr(), second.data_ptr(), weight.data_ptr()}
    assert len(pointers) == 3, "every read is a copy of its own, never the model's tensor"
    # The optimizer's starting state, as torch's optimizer starts it.
    names = {"adam": ("exp_avg", "exp_avg_sq"), "adagrad": ("sum",),
             "sgd_momentum": ("momentum_buffer",)}[name]
    for state_name in names:
        made = state[f"0.weight.{state_name}"]
        assert made.shape == weight.shape and made.dtype == weight.dtype
        expected = 0.25 if name == "adagrad" else 0.0
        assert torch.equal(made, torch.full_like(weight, expected))


def test_take_frees_the_model_before_making_the_optimizer_state_and_says_who_did():
    model, program = captured(OPTIMIZERS["adam"])
    state = program.initial_state.copy()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    own = ["2.weight", "2.bias", "2.weight.exp_avg", "2.weight.exp_avg_sq"]
    taken = state.take(own, free_sources=True, taker="server 1")
    assert list(taken) == own
    assert torch.equal(taken["2.weight"], before["2.weight"])
    assert torch.equal(taken["2.bias"], before["2.bias"])
    assert torch.equal(taken["2.weight.exp_avg_sq"], torch.zeros(2, 5))
    for parameter in model.parameters():  # the model here holds no memory now
        assert parameter.untyped_storage().nbytes() == 0
    with pytest.raises(SplitrunError, match=r"initial state '0.weight' is gone: server 1 freed "
                                            r"the model's tensors.*trainer.finish\(\)"):
        state["0.weight"]
    # What reads only a shape still works; a subset or copy names nothing anew.
    assert torch.equal(state["0.weight.exp_avg"], torch.zeros(5, 6))
    assert repr(state.subset(["0.weight"])) == "InitialState(1 entries, 1 made when taken)"


def test_take_without_freeing_leaves_the_model_alone():
    model, program = captured(OPTIMIZERS["sgd_momentum"])
    taken = program.initial_state.take(["0.weight"])
    assert torch.equal(taken["0.weight"], model[0].weight)
    assert model[0].weight.untyped_storage().nbytes() == 6 * 5 * 4


def test_an_optimizers_own_init_state_is_what_each_entry_is_made_from():
    class Shifted(optim.SGD):
        def init_state(self, param):
            return {"momentum_buffer": torch.full_like(param, 3.0)}

    functional = Shifted(lr=0.1, momentum=0.9)
    param = torch.randn(3, 2)
    assert torch.equal(functional.init_state_entry(param, "momentum_buffer"),
                       torch.full_like(param, 3.0))
    assert torch.equal(optim.Adagrad(initial_accumulator_value=0.5).init_state_entry(param, "sum"),
                       torch.full_like(param, 0.5))


def test_a_plain_dict_becomes_an_initial_state_and_writes_stay_plain():
    state = InitialState({"a": torch.ones(2)})
    state["b"] = Deferred(torch.zeros(3), torch.clone)
    state["a"] = torch.full((2,), 2.0)
    assert torch.equal(state["a"], torch.full((2,), 2.0))
    assert torch.equal(state["b"], torch.zeros(3)) and len(state) == 2
    del state["a"]
    assert list(state) == ["b"]
