"""An exact oracle for the propagation problem, independent of the solver: the
objective in whole bytes, written as an integer program and solved by HiGHS
(`scipy.optimize.milp`).

Enumerating every combination (`solver.brute_force`) is the plainest oracle,
but a captured step has 1e10 to 1e30 combinations; the integer program finds
the same optimum (tests/splitter/test_parallel_propagation.py checks that it does on
problems small enough to enumerate) on steps of hundreds of variables.

Whole bytes: every cost is rounded down to bytes (`cost.bytes_of`), dropping
the sub-byte tie-breakers the solver adds (a local copy, each collective's
round): proving the best of those tie-breakers optimal takes HiGHS minutes
on a step of a few hundred variables, whole bytes seconds. The solver's
tie-breakers add up to less than a byte, so its choice is also least in
whole bytes when it is least in its own terms.

The program: a 0/1 variable x[v, c] per variable and candidate, one per
variable set; per value, token t some reader may need and candidate c of the
value's producer, w[c, t] <= x[src, c], which costs what making t from c's
token costs (no w where that is impossible); sum_c w[c, t] >= x[r, b] for
every reader r whose candidate b needs t (>= 1 for a fixed reader). At an
integral x only the producer's chosen candidate has w, so costs >= 0 make
w[c, t] the indicator "t is needed" that `Problem.value_cost` sums over. Its
linear relaxation is much tighter than the product written
z >= x[src, c] + y[t] - 1 (which a fractional x satisfies at no cost): HiGHS
proves the optimum in a fraction of the branching.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from splitrun.splitter.modes.parallel import Problem
from splitrun.splitter.modes.parallel.cost import bytes_of


def whole_bytes(cost: float) -> float:
    return cost if math.isinf(cost) else float(bytes_of(cost))


def whole_bytes_cost(problem: Problem, choice: list[int]) -> float:
    """The cost of `choice` in whole bytes, term by term (written apart from
    `solver.total_cost` on purpose)."""
    total = sum(whole_bytes(problem.unary[v][c]) for v, c in enumerate(choice))
    for value in problem.values:
        made = value.makes[choice[value.src]]
        needed = {use.needs[0] if use.dst < 0 else use.needs[choice[use.dst]]
                  for use in value.uses}
        total += sum(whole_bytes(value.between(made, token)) for token in needed
                     if token != made)
    return total


class OracleOutOfTime(Exception):
    """The integer program was not solved to optimality within its time limit;
    `lower_bound` is what the solver proved: no choice costs less."""

    def __init__(self, lower_bound: float, message: str) -> None:
        super().__init__(message)
        self.lower_bound = lower_bound


def exact_choice(problem: Problem, time_limit_s: float = 120.0) -> tuple[list[int], float]:
    """(a choice of every variable least in whole bytes, that least cost).
    Raises OracleOutOfTime when the solver needs longer than `time_limit_s`."""
    counts = problem.num_candidates
    columns: list[float] = []       # objective coefficient of each column
    integral: list[int] = []
    x_col: dict[tuple[int, int], int] = {}
    rows: list[dict[int, float]] = []
    lower: list[float] = []
    upper: list[float] = []

    def column(cost: float, is_integral: bool) -> int:
        columns.append(cost)
        integral.append(1 if is_integral else 0)
        return len(columns) - 1

    def row(entries: dict[int, float], lo: float, hi: float) -> None:
        rows.append(entries)
        lower.append(lo)
        upper.append(hi)

    for v, count in enumerate(counts):
        for c in range(count):
            x_col[v, c] = column(whole_bytes(problem.unary[v][c]), True)
        row({x_col[v, c]: 1.0 for c in range(count)}, 1.0, 1.0)

    for value in problem.values:
        needed: dict[object, list[int | None]] = {}   # token -> x columns (None: always)
        for use in value.uses:
            if use.dst < 0:
                needed.setdefault(use.needs[0], []).append(None)
                continue
            for b, token in enumerate(use.needs):
                needed.setdefault(token, []).append(x_col[use.dst, b])
        for token, readers in needed.items():
            # w[c] = x[src, c] * y[t]: per candidate c of the producer, "c made
            # the value and t is needed"; sum_c w[c] >= every reader of t.
            made_here = {}
            for c, made in enumerate(value.makes):
                cost = 0.0 if made == token else whole_bytes(value.between(made, token))
                if math.isinf(cost):
                    continue
                w = column(cost, False)
                made_here[w] = 1.0
                row({w: 1.0, x_col[value.src, c]: -1.0}, -math.inf, 0.0)
            for reader in readers:
                if reader is None:
                    row(dict(made_here), 1.0, math.inf)
                else:
                    row({**made_here, reader: -1.0}, 0.0, math.inf)
    data, row_index, col_index = [], [], []
    for r, entries in enumerate(rows):
        for col, coefficient in entries.items():
            row_index.append(r)
            col_index.append(col)
            data.append(coefficient)
    matrix = coo_matrix((data, (row_index, col_index)), shape=(len(rows), len(columns)))
    result = milp(np.array(columns), integrality=np.array(integral), bounds=Bounds(0.0, 1.0),
                  constraints=LinearConstraint(matrix.tocsr(), np.array(lower), np.array(upper)),
                  options={"mip_rel_gap": 0.0, "time_limit": time_limit_s})
    if result.status == 1:  # the time limit
        bound = result.get("mip_dual_bound")  # None when the solver proved none
        raise OracleOutOfTime(-math.inf if bound is None else bound, result.message)
    assert result.status == 0, f"the integer program did not solve: {result.message}"
    choice = []
    for v, count in enumerate(counts):
        picked = [c for c in range(count) if result.x[x_col[v, c]] > 0.5]
        assert len(picked) == 1
        choice.append(picked[0])
    least = whole_bytes_cost(problem, choice)
    assert math.isclose(least, result.fun, rel_tol=1e-9, abs_tol=1e-3), (least, result.fun)
    return choice, least
