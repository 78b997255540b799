"""A 0-dim parameter (a learnable temperature) owned by one process and read
on another trains exactly as in one process and stays float32, with every
functional optimizer, in general and parameter-server mode.

Tolerance: none in general mode (the same ops on the same values); 1e-6 in
parameter-server mode (shard gradients sum in another order).
"""

import pytest
import torch
from scalar_models import NUM_STEPS, OPTIMIZERS, feeds, make

from splitrun.runtime import run_threaded
from splitrun.splitter import Cluster, ParameterServerMode, optim, split_program


def test_update_keeps_the_dtype_of_a_0_dim_parameter():
    for name, make_optimizer in OPTIMIZERS.items():
        functional = make_optimizer()
        param = torch.tensor(0.5, dtype=torch.float32)
        state = functional.init_state(param)
        lr = torch.tensor(0.1, dtype=optim.HPARAM_DTYPE)
        step = torch.tensor(1.0, dtype=optim.HPARAM_DTYPE)
        new, new_state = functional.update(param, torch.tensor(0.3), state, lr, step)
        assert new.dtype == torch.float32, name
        assert all(v.dtype == torch.float32 for v in new_state.values()), name


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_scalar_on_another_worker_equals_one_process(optimizer):
    program, batches = make({"rank": 1}, optimizer, 8)
    plan = split_program(program, Cluster(num_workers=2))
    run = run_threaded(plan, NUM_STEPS, feeds(batches), recv_timeout_s=30)
    history, expected = program.train_unsplit(NUM_STEPS, feeds(batches))
    for key, value in expected.items():
        assert run.state[key].dtype == value.dtype == torch.float32, key
        assert torch.equal(run.state[key], value), f"{key} differs from one process"
    assert not torch.equal(run.state["log_temp"], program.initial_state["log_temp"])


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_scalar_on_a_server_equals_one_process(optimizer):
    program, batches = make({"role": "server"}, optimizer, 4)
    full, _ = make({"role": "server"}, optimizer, 8)
    plan = split_program(program, Cluster(num_workers=2, num_servers=1), ParameterServerMode())
    run = run_threaded(plan, NUM_STEPS, feeds(batches), recv_timeout_s=30)
    _, expected = full.train_unsplit(NUM_STEPS, feeds(batches))
    for key, value in expected.items():
        assert run.state[key].dtype == torch.float32, key
        torch.testing.assert_close(run.state[key], value, rtol=0, atol=1e-6)
    assert run.state["log_temp"].dim() == 0
