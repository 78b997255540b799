"""Sharding propagation: the policies, exactness on small problems, and
global never worse than the rules it starts from."""

import random

import pytest
import torch
from hypothesis import given, reject, settings
from hypothesis import strategies as st
from parallel_models import capture_mlp

from splitrun.splitter import Policy
from splitrun.splitter.modes.parallel import (
    P,
    Problem,
    R,
    S,
    Use,
    Value,
    brute_force,
    propagate,
    redistribute_bytes,
    solve,
    total_cost,
)

# Seconds the integer-program oracle may take for one random model (typically
# well under one).
ORACLE_TIME_LIMIT_S = 15.0


def test_with_only_the_first_linear_pinned_the_second_comes_out_row_parallel():
    program = capture_mlp("adam", pin_second=False)
    for policy in ("greedy", "global"):
        layout = propagate(program, 2, policy=policy)
        assert layout.placement("p_l1_weight") == S(0)
        assert layout.placement("p_l2_weight") == S(1), policy
        assert layout.placement("o_l2_weight_exp_avg") == S(1), "state follows its parameter"
        assert layout.placement("p_l2_bias") == R
        # one all-reduce of the [8, 4] float output: 2(N-1)·128 bytes in all
        assert layout.cost_bytes == 2 * 128, policy


def test_first_policy_is_dtensors_rule_and_costs_more_here():
    program = capture_mlp("adam", pin_second=False)
    costs = {p: propagate(program, 2, policy=p).cost_bytes for p in ("first", "greedy", "global")}
    assert costs["global"] <= costs["greedy"] <= costs["first"]
    assert costs["first"] > costs["global"]


def test_explain_names_the_choice_and_the_alternatives():
    layout = propagate(capture_mlp("sgd"), 2)
    text = layout.explain()
    assert "addmm_1: (P, S(1), S(0)) -> P" in text
    assert "alternatives:" in text


def test_redistribution_costs():
    shape, n = (8, 4), 4
    size = 8 * 4 * 4
    def sent(src, dst, shape=shape):  # bytes, without the sub-byte tie-breakers
        return int(redistribute_bytes(src, dst, shape, 4, n))

    assert sent(S(0), R) == 3 * size          # all-gather
    assert sent(P, R) == 2 * 3 * size         # reduce-scatter then all-gather
    assert sent(P, S(1)) == 3 * size          # reduce-scatter
    assert sent(S(0), S(1)) == 3 * size // 4  # all-to-all
    assert sent(R, S(0)) == 0                 # a local slice
    assert sent(P, R, ()) == n * (n - 1) * 4  # nothing to scatter: summed whole
    # equal bytes, fewer collectives: one all-reduce beats reduce-scatter + all-gather
    assert redistribute_bytes(P, R, shape, 4, n) < \
        redistribute_bytes(P, S(0), shape, 4, n) + redistribute_bytes(S(0), R, shape, 4, n)


# -- random problems -------------------------------------------------------------------

def random_problem(rng: random.Random, num_vars: int, max_candidates: int = 3,
                   num_tokens: int = 3) -> Problem:
    counts = [rng.randint(1, max_candidates) for _ in range(num_vars)]
    matrix = [[0 if a == b else rng.choice([1, 2, 4, 8, 16]) for b in range(num_tokens)]
              for a in range(num_tokens)]
    values = []
    followers = {}
    for src in range(num_vars):
        makes = tuple(rng.randrange(num_tokens) for _ in range(counts[src]))
        uses = []
        later = list(range(src + 1, num_vars))
        for dst in rng.sample(later, k=min(len(later), rng.randint(0, 3))):
            uses.append(Use(dst, tuple(rng.randrange(num_tokens) for _ in range(counts[dst]))))
        if rng.random() < 0.2:
            uses.append(Use(-1, (rng.randrange(num_tokens),)))
        scale = rng.choice([1, 3, 10])
        values.append(Value(src, makes, uses,
                            lambda a, b, s=scale: s * matrix[a][b]))
        if len(uses) == 1 and uses[0].dst >= 0 and rng.random() < 0.5:
            followers[src] = [uses[0].dst]
    unary = [[rng.choice([0, 0, 1]) for _ in range(c)] for c in counts]
    return Problem(counts, values, unary, followers)


@pytest.mark.parametrize("seed", range(40))
def test_global_equals_brute_force_on_small_problems(seed):
    problem = random_problem(random.Random(seed), num_vars=random.Random(seed).randint(3, 8))
    _, best = brute_force(problem)
    assert total_cost(problem, solve(problem, Policy.GLOBAL)) == best


def test_global_equals_brute_force_on_a_captured_graph():
    # A tiny step without optimizer: y = x @ W^T summed; small enough to enumerate.
    from torch import nn

    from splitrun.splitter import capture
    from splitrun.splitter.modes.parallel import build_problem

    torch.manual_seed(0)
    model = nn.Linear(4, 2, bias=False)
    program = capture(model, lambda m, x: m(x).sum(), None, torch.randn(3, 4))
    problem, _ = build_problem(program, 2, {"p_weight": S(0)})
    _, best = brute_force(problem)
    assert total_cost(problem, solve(problem, Policy.GLOBAL)) == pytest.approx(best)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=10**9), st.integers(min_value=5, max_value=40))
def test_global_is_never_worse_than_greedy_or_first(seed, num_vars):
    problem = random_problem(random.Random(seed), num_vars)
    cost = {policy: total_cost(problem, solve(problem, policy)) for policy in Policy}
    assert cost[Policy.GLOBAL] <= cost[Policy.GREEDY]
    assert cost[Policy.GLOBAL] <= cost[Policy.FIRST]


def test_unknown_policy_is_refused():
    from splitrun.splitter import PlanError

    with pytest.raises(PlanError, match="unknown propagation policy 'best'.*first, greedy, global"):
        Policy.parse("best")


def test_shard_pins_a_functions_inputs_and_outputs_and_a_modules_parameters():
    from torch import nn

    from splitrun.splitter import capture, constrain, convert_parallel_linear, optim, shard

    def dense_relu(x, weight):
        return torch.relu(x @ weight)

    sharded = shard(dense_relu, in_strategy=(None, (1, 2)), out_strategy=("S(1)",))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 16))
            self.head = shard(nn.Linear(16, 4), parameter_plan={"weight": "S(1)"})

        def forward(self, x):
            return self.head(sharded(x, self.w))

    torch.manual_seed(0)
    program = capture(Model(), lambda m, x, y: torch.nn.functional.mse_loss(m(x), y),
                      optim.SGD(lr=0.1), (torch.randn(4, 8), torch.randn(4, 4)))
    layout = propagate(program, 2)
    assert layout.placement("p_w") == S(1), "(1, 2) on the weight: its columns"
    assert layout.placement("p_head_weight") == S(1), "parameter_plan pins the parameter"
    # the pinned output feeds a row-parallel head: one all-reduce of [4, 4] floats
    assert layout.cost_bytes == 2 * 4 * 4 * 4

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    before = [p.detach().clone() for p in model.parameters()]
    convert_parallel_linear(model, dim=-1)
    assert type(model[0]).__name__ == "ParallelLinear" and model[2].dim == -1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert constrain(torch.ones(2), "R").shape == (2,)


# -- the exact search on captured steps ------------------------------------------------

class ColumnTanhLinear(torch.nn.Module):
    """The issue's model: a column-parallel linear, tanh, a plain linear."""

    def __init__(self, batch_hidden: int = 64) -> None:
        super().__init__()
        from splitrun.splitter import ParallelLinear
        self.up = ParallelLinear(8, batch_hidden, dim=-1)
        self.down = torch.nn.Linear(batch_hidden, 4)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


@pytest.mark.parametrize("n, expected", [(2, 384), (4, 1152)])
def test_global_makes_the_plain_linear_after_a_column_parallel_one_row_parallel(n, expected):
    # With cross-entropy the step is entangled enough that local search stopped
    # at an all-gather of the tanh (3 072 B at 2 ranks); the cheapest layout
    # shards the second weight by its input features and all-reduces the
    # [12, 4] logits once (2(n-1) x 192 B in all).
    from splitrun.splitter import Cluster, ParallelMode, capture, optim, split_program

    torch.manual_seed(0)
    program = capture(ColumnTanhLinear(), lambda m, x, y: torch.nn.functional.cross_entropy(
        m(x), y), optim.Adam(lr=1e-2), (torch.randn(12, 8), torch.randint(0, 4, (12,))))
    layout = propagate(program, n, collective_cost=n * 8192)
    assert layout.placement("p_down_weight") == S(1)
    assert layout.cost_bytes == expected
    split = split_program(program, Cluster(num_workers=n), ParallelMode())
    collectives = split.artifacts.collectives
    assert [c.kind.value for c in collectives] == ["all-reduce"], split.plan.explain()
    assert sum(c.nbytes for c in collectives) == expected


def test_readme_pattern_with_cross_entropy_is_row_parallel_too():
    from splitrun.splitter import ParallelLinear, capture, optim

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = ParallelLinear(8, 32, dim=-1)
            self.down = torch.nn.Linear(32, 4)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    program = capture(MLP(), lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y),
                      optim.Adam(lr=1e-2), (torch.randn(16, 8), torch.randint(0, 4, (16,))))
    layout = propagate(program, 2, collective_cost=2 * 8192)
    assert layout.placement("p_down_weight") == S(1)
    assert layout.cost_bytes == 2 * 16 * 4 * 4   # one all-reduce of the [16, 4] logits


def test_the_exact_oracle_equals_brute_force():
    from exact_oracle import exact_choice

    for seed in range(30):
        rng = random.Random(seed)
        problem = random_problem(rng, num_vars=rng.randint(3, 8))  # whole costs
        _, best = brute_force(problem)
        assert exact_choice(problem)[1] == best


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=0, max_value=10**9), st.integers(min_value=5, max_value=30))
def test_local_search_is_never_worse_than_greedy_or_first(seed, num_vars):
    # The fallback for steps too entangled to solve exactly, forced here by a
    # table limit below every problem's tables.
    problem = random_problem(random.Random(seed), num_vars)
    local = total_cost(problem, solve(problem, Policy.GLOBAL, max_table_entries=1))
    assert local <= total_cost(problem, solve(problem, Policy.GREEDY))
    assert local <= total_cost(problem, solve(problem, Policy.FIRST))


@pytest.mark.timeout(20 * 2 * ORACLE_TIME_LIMIT_S)  # 20 draws, 2 solves each
@settings(max_examples=20, deadline=None)
@given(st.data())
def test_global_is_never_worse_than_the_exact_oracle_on_random_models(data):
    # Random small steps: chains and residual blocks of linears, layer norms,
    # activations and embeddings, a loss, pins at random; the whole step
    # (forward, backward, optimizer) placed over 2 or 4 ranks, on bytes alone
    # and with the mode's default cost per collective. Enumerating every
    # combination is out of reach (1e10 and more); the oracle is an integer
    # program, checked against enumeration above.
    # An unlucky draw can keep the solver busy for minutes on a loaded machine:
    # each solve has ORACLE_TIME_LIMIT_S; past it, the bound the solver proved
    # still decides when `found` is within it, and otherwise the draw is
    # rejected as undecided (never passed).
    from exact_oracle import OracleOutOfTime, exact_choice, whole_bytes_cost
    from random_models import capture_random_model

    from splitrun.splitter.modes.parallel import build_problem

    program, n = capture_random_model(data.draw)
    for collective_cost in (0.0, n * 8192.0):
        problem, _ = build_problem(program, n, collective_cost=collective_cost)
        found = whole_bytes_cost(problem, solve(problem, Policy.GLOBAL))
        try:
            _, best = exact_choice(problem, time_limit_s=ORACLE_TIME_LIMIT_S)
        except OracleOutOfTime as out_of_time:
            if found > out_of_time.lower_bound + 1e-3:
                reject()
            continue
        assert found <= best, (found, best)
