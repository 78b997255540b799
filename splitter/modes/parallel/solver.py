"""Choosing one strategy per variable so that the bytes sent per step are least.

The problem is plain data (`Problem`): variables in topological order, each
with its candidates; values, each produced by one variable (its output
`token` depends on the producer's candidate) and read by consumers (the token
each needs depends on the consumer's candidate). A value is redistributed at
most once per distinct token its consumers need, so a value's cost is the sum,
over those distinct tokens, of `cost(produced, needed)`. Four policies:

- `first` (DTensor's rule): in order, the first candidate that needs no
  communication from the producers already decided, else candidate 0.
- `greedy` (op by op): in order, the candidate with the least cost against
  what is already decided. A variable with no decided producer (a parameter,
  or a view of one) is left open until its first consumer decides: that
  consumer picks the best placement for it through its chain of views.
- `global`: the whole step's cost, exactly, by variable elimination
  (`elimination.py`: dynamic programming over the step's chains and ladders),
  whenever each of its tables stays under `elimination.MAX_TABLE_ENTRIES`.
  A step too entangled for that gets local search from the better of `first`
  and `greedy`: sweeps that move one variable together with its followers
  (views that only re-express it) and let its neighbours re-pick, then exact
  neighbourhoods, until a sweep finds nothing cheaper; never worse than either
  starting point, but it can stop in a local minimum (logged).
- `brute_force`: every combination; for tests on small problems.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from ...errors import PlanError
from .elimination import MAX_TABLE_ENTRIES, solve_exactly

__all__ = ["Policy", "Problem", "Value", "Use", "solve", "brute_force", "total_cost",
           "local_costs"]

logger = logging.getLogger(__name__)

# Below this a cost sends nothing (only tie-breakers), for `first`.
_NO_BYTES = 0.5
# Local search stops after this many sweeps even if it still improves.
MAX_SWEEPS = 20


class Policy(Enum):
    FIRST = "first"
    GREEDY = "greedy"
    GLOBAL = "global"

    @classmethod
    def parse(cls, value: Policy | str) -> Policy:
        if isinstance(value, Policy):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise PlanError(
                f"unknown propagation policy {value!r}; expected one of "
                f"{', '.join(p.value for p in cls)}") from None


@dataclass(frozen=True, slots=True)
class Use:
    """`dst` reads the value; with candidate b it needs token `needs[b]`.
    `dst = -1` is a fixed requirement (the loss must come out whole)."""

    dst: int
    needs: tuple[Hashable, ...]


@dataclass(slots=True)
class Value:
    src: int
    makes: tuple[Hashable, ...]   # token produced under each candidate of src
    uses: list[Use]
    cost: Callable[[Hashable, Hashable], float]  # (produced, needed) -> bytes
    memo: dict = field(default_factory=dict, repr=False)

    def between(self, made: Hashable, needed: Hashable) -> float:
        key = (made, needed)
        found = self.memo.get(key)
        if found is None:
            found = self.memo[key] = self.cost(made, needed)
        return found


@dataclass
class Problem:
    num_candidates: list[int]
    values: list[Value]
    unary: list[list[float]] = field(default_factory=list)
    # `followers[v]`: variables whose only input is v and that merely re-express
    # it (views); local search moves them with v.
    followers: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.unary:
            self.unary = [[0.0] * n for n in self.num_candidates]
        self.touching: list[list[int]] = [[] for _ in self.num_candidates]
        self.producers: list[list[int]] = [[] for _ in self.num_candidates]
        for index, value in enumerate(self.values):
            self.touching[value.src].append(index)
            for use in value.uses:
                if use.dst >= 0 and use.dst != value.src:
                    if index not in self.touching[use.dst]:
                        self.touching[use.dst].append(index)
                    if value.src < use.dst and value.src not in self.producers[use.dst]:
                        self.producers[use.dst].append(value.src)

    @property
    def num_vars(self) -> int:
        return len(self.num_candidates)

    def value_cost(self, index: int, choice: Sequence[int | None]) -> float:
        """Cost of one value with the decided part of `choice` (None: open)."""
        value = self.values[index]
        made_by = choice[value.src]
        if made_by is None:
            return 0.0
        made = value.makes[made_by]
        needed = []
        for use in value.uses:
            if use.dst < 0:
                token = use.needs[0]
            elif choice[use.dst] is None:
                continue
            else:
                token = use.needs[choice[use.dst]]
            if token != made and token not in needed:
                needed.append(token)
        return sum(value.between(made, token) for token in needed)


def total_cost(problem: Problem, choice: Sequence[int | None]) -> float:
    cost = sum(problem.unary[v][c] for v, c in enumerate(choice) if c is not None)
    return cost + sum(problem.value_cost(i, choice) for i in range(len(problem.values)))


def local_costs(problem: Problem, choice: Sequence[int | None], var: int) -> list[float]:
    """The cost of every candidate of `var` (values it touches and its unary
    cost), the other variables as in `choice`."""
    trial = list(choice)
    costs = []
    for cand in range(problem.num_candidates[var]):
        trial[var] = cand
        costs.append(problem.unary[var][cand]
                     + sum(problem.value_cost(i, trial) for i in problem.touching[var]))
    return costs


def solve(problem: Problem, policy: Policy | str, *,
          max_table_entries: int = MAX_TABLE_ENTRIES) -> list[int]:
    """One candidate per variable under `policy`. `max_table_entries`: the
    largest table `global` builds for its exact search before it searches
    locally instead."""
    policy = Policy.parse(policy)
    if policy is Policy.FIRST:
        return _first(problem)
    if policy is Policy.GREEDY:
        return _greedy(problem)
    return _global(problem, max_table_entries)


def brute_force(problem: Problem) -> tuple[list[int], float]:
    best, best_cost = None, math.inf
    for choice in itertools.product(*[range(n) for n in problem.num_candidates]):
        cost = total_cost(problem, choice)
        if cost < best_cost:
            best, best_cost = list(choice), cost
    return best, best_cost


# -- first and greedy ------------------------------------------------------------

def _first(problem: Problem) -> list[int]:
    choice: list[int | None] = [None] * problem.num_vars
    for var in range(problem.num_vars):
        costs = local_costs(problem, choice, var)
        choice[var] = next((c for c, cost in enumerate(costs) if cost < _NO_BYTES), 0)
    return choice  # type: ignore[return-value]


def _greedy(problem: Problem) -> list[int]:
    choice: list[int | None] = [None] * problem.num_vars
    open_vars: set[int] = set()
    for var in range(problem.num_vars):
        producers = problem.producers[var]
        if (not producers and problem.num_candidates[var] > 1) or \
                (len(producers) == 1 and producers[0] in open_vars):
            open_vars.add(var)
            continue
        lazy = [p for p in producers if p in open_vars]
        best, best_cost, best_plan = 0, math.inf, {}
        for cand in range(problem.num_candidates[var]):
            trial = list(choice)
            trial[var] = cand
            plan: dict[int, int] = {}
            for producer in lazy:
                options = _open_options(problem, choice, producer)
                cheapest, how = math.inf, {}
                for assignment, inner in options:
                    attempt = list(trial)
                    for other, c in assignment.items():
                        attempt[other] = c
                    cost = inner + sum(problem.value_cost(i, attempt)
                                       for i in problem.touching[var])
                    if cost < cheapest:
                        cheapest, how = cost, assignment
                plan.update(how)
            for other, c in plan.items():
                trial[other] = c
            cost = problem.unary[var][cand] + sum(problem.value_cost(i, trial)
                                                  for i in problem.touching[var])
            cost += sum(problem.unary[o][c] for o, c in plan.items())
            if cost < best_cost:
                best, best_cost, best_plan = cand, cost, plan
        for other, cand in best_plan.items():
            if choice[other] is None:
                choice[other] = cand
                open_vars.discard(other)
        choice[var] = best
    for var in range(problem.num_vars):  # open variables no consumer decided
        if choice[var] is None:
            costs = local_costs(problem, choice, var)
            choice[var] = costs.index(min(costs))
    return choice  # type: ignore[return-value]


def _open_options(problem, choice, var) -> list[tuple[dict[int, int], float]]:
    """Every way to decide an open variable and its chain of open producers:
    (assignment, cost inside the chain)."""
    open_producers = [p for p in problem.producers[var] if choice[p] is None]
    if not open_producers:
        return [({var: c}, 0.0) for c in range(problem.num_candidates[var])]
    options = []
    for inner, inner_cost in _open_options(problem, choice, open_producers[0]):
        trial = list(choice)
        for other, c in inner.items():
            trial[other] = c
        costs = local_costs(problem, trial, var)
        best = min(range(len(costs)), key=costs.__getitem__)
        options.append(({**inner, var: best}, inner_cost + costs[best]))
    return options


# -- global ------------------------------------------------------------------------

def _global(problem: Problem, max_table_entries: int) -> list[int]:
    exact = solve_exactly(problem, max_table_entries)
    if exact is not None:
        return exact
    logger.info("parallel mode: the step is too entangled to place exactly (%d variables); "
                "searching locally, which may miss the cheapest layout", problem.num_vars)
    first, greedy = _first(problem), _greedy(problem)
    start = min((first, greedy), key=lambda c: total_cost(problem, c))
    return _local_search(problem, list(start))


def _local_search(problem: Problem, choice: list[int]) -> list[int]:
    """Sweeps of two kinds of move until neither finds anything cheaper: one
    variable with its followers (neighbours re-pick once), and the exact
    best of a small neighbourhood (a variable, its followers and the nearest
    variables it shares values with), the rest held fixed."""
    current = total_cost(problem, choice)
    neighbours = _adjacency(problem)
    use_windows = False
    for _ in range(MAX_SWEEPS):
        improved = False
        for var in range(problem.num_vars):
            for cand in range(problem.num_candidates[var]):
                if cand == choice[var]:
                    continue
                trial = _move(problem, choice, var, cand)
                delta = _delta(problem, choice, trial)
                if delta < -1e-9:
                    choice, current, improved = trial, current + delta, True
            if not use_windows:
                continue
            window = _window(problem, neighbours, var)
            if len(window) > 1:
                trial = _best_in_window(problem, choice, window)
                delta = _delta(problem, choice, trial)
                if delta < -1e-9:
                    choice, current, improved = trial, current + delta, True
        if not improved:
            if use_windows:
                break
            use_windows = True  # single moves are stuck: try neighbourhoods
    return choice


# A neighbourhood solved exactly holds at most this many combinations.
WINDOW_COMBINATIONS = 400


def _delta(problem: Problem, before: list[int], after: list[int]) -> float:
    """total_cost(after) - total_cost(before), from the values that changed."""
    changed = [v for v in range(problem.num_vars) if before[v] != after[v]]
    if not changed:
        return 0.0
    touched = {i for v in changed for i in problem.touching[v]}
    delta = sum(problem.unary[v][after[v]] - problem.unary[v][before[v]] for v in changed)
    for i in touched:
        delta += problem.value_cost(i, after) - problem.value_cost(i, before)
    return delta


def _adjacency(problem: Problem) -> list[list[int]]:
    adjacent: list[set[int]] = [set() for _ in range(problem.num_vars)]
    for value in problem.values:
        ends = {value.src} | {u.dst for u in value.uses if u.dst >= 0}
        for end in ends:
            adjacent[end] |= ends - {end}
    return [sorted(a) for a in adjacent]


def _window(problem: Problem, neighbours: list[list[int]], var: int) -> list[int]:
    """`var`, its followers, then variables breadth-first, while the product
    of their candidate counts stays within WINDOW_COMBINATIONS."""
    window, size = [var], problem.num_candidates[var]
    queue = list(problem.followers.get(var, ())) + neighbours[var]
    seen = {var}
    while queue:
        other = queue.pop(0)
        if other in seen:
            continue
        seen.add(other)
        count = problem.num_candidates[other]
        if count == 1:
            continue
        if size * count > WINDOW_COMBINATIONS:
            continue
        window.append(other)
        size *= count
        queue.extend(problem.followers.get(other, ()))
        queue.extend(neighbours[other])
    return window


def _best_in_window(problem: Problem, choice: list[int], window: list[int]) -> list[int]:
    touching = sorted({i for v in window for i in problem.touching[v]})
    trial = list(choice)
    best, best_cost = list(choice), math.inf
    for combo in itertools.product(*[range(problem.num_candidates[v]) for v in window]):
        for v, c in zip(window, combo):
            trial[v] = c
        cost = sum(problem.unary[v][trial[v]] for v in window) + \
            sum(problem.value_cost(i, trial) for i in touching)
        if cost < best_cost:
            best, best_cost = list(trial), cost
    return best


def _move(problem: Problem, choice: list[int], var: int, cand: int) -> list[int]:
    """Set `var` to `cand`, carry its followers along, and let each neighbour
    re-pick its cheapest candidate once."""
    trial = list(choice)
    trial[var] = cand
    moved = [var]
    queue = list(problem.followers.get(var, ()))
    while queue:
        follower = queue.pop(0)
        costs = local_costs(problem, trial, follower)
        trial[follower] = costs.index(min(costs))
        moved.append(follower)
        queue.extend(problem.followers.get(follower, ()))
    neighbours: set[int] = set()
    for m in moved:
        for index in problem.touching[m]:
            value = problem.values[index]
            neighbours.add(value.src)
            neighbours.update(u.dst for u in value.uses if u.dst >= 0)
    for other in sorted(neighbours - set(moved)):
        costs = local_costs(problem, trial, other)
        trial[other] = costs.index(min(costs))
    return trial
