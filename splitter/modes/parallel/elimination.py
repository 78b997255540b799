"""The exact least-cost choice by variable elimination (min-sum dynamic programming).

A `solver.Problem` is a sum of small terms: each variable's unary cost and
each value's cost, a function of its producer's and its readers' candidates.
Eliminating a variable replaces the terms that mention it by one term over
its neighbours: the least cost of those terms for every combination of the
neighbours' candidates, remembering which candidate of the variable attains it.
After the last variable the least total is known; walking the eliminations
backwards picks every variable's candidate. This is dynamic programming over
the step's structure: along a chain each elimination sees two or three
neighbours, and a training step (forward, backward, optimizer) is a ladder of
such chains, so the tables stay small (at most a few thousand entries for the
tests' and examples' models).

The order is chosen greedily (the variable whose elimination builds the
smallest table first). When a table would exceed `max_entries` the problem is
too entangled for this method and `solve_exactly` returns None; the caller
then searches locally. Tables are torch tensors (the splitter's one
dependency): each elimination is a few broadcast additions and comparisons.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["solve_exactly", "MAX_TABLE_ENTRIES"]

# A `solver.Problem` (not imported: the solver imports this module).
Problem = Any

# The largest table one elimination may build (float64 entries: 32 MiB).
MAX_TABLE_ENTRIES = 1 << 22


@dataclass
class _Term:
    scope: tuple[int, ...]      # free variables, in the order of the table's dimensions
    table: torch.Tensor


def solve_exactly(problem: Problem, max_entries: int = MAX_TABLE_ENTRIES) -> list[int] | None:
    """The least-cost choice of every variable, or None when some elimination
    would build a table of more than `max_entries` entries."""
    counts = problem.num_candidates
    free = [v for v, count in enumerate(counts) if count > 1]
    scopes = [_scope(problem, index, counts) for index in range(len(problem.values))]
    order = _elimination_order(free, scopes, counts, max_entries)
    if order is None:
        return None
    terms: list[_Term | None] = []
    by_var: dict[int, set[int]] = {v: set() for v in free}

    def add(term: _Term) -> None:
        terms.append(term)
        for v in term.scope:
            by_var[v].add(len(terms) - 1)

    for v in free:
        add(_Term((v,), torch.tensor(problem.unary[v], dtype=torch.float64)))
    for index, scope in enumerate(scopes):
        if scope:
            add(_Term(scope, _value_table(problem, index, scope, counts)))
    # (variable, the other variables of its table, its best candidate for each
    # combination of theirs)
    picks: list[tuple[int, tuple[int, ...], torch.Tensor]] = []
    for v in order:
        mine = sorted(by_var.pop(v))
        scope = tuple(sorted({u for i in mine for u in terms[i].scope} - {v}))
        full = (v, *scope)
        table = torch.zeros([counts[u] for u in full], dtype=torch.float64)
        for i in mine:
            table = table + _broadcast(terms[i], full, counts)
            for u in terms[i].scope:
                if u != v:
                    by_var[u].discard(i)
            terms[i] = None
        best, argbest = _least(table)
        picks.append((v, scope, argbest))
        if scope:
            add(_Term(scope, best))
    choice = [0] * len(counts)
    for v, scope, argbest in reversed(picks):
        choice[v] = int(argbest[tuple(choice[u] for u in scope)])
    return choice


def _scope(problem: Problem, index: int, counts: Sequence[int]) -> tuple[int, ...]:
    value = problem.values[index]
    ends = {value.src} | {use.dst for use in value.uses if use.dst >= 0}
    return tuple(sorted(v for v in ends if counts[v] > 1))


def _elimination_order(free: list[int], scopes: list[tuple[int, ...]], counts: Sequence[int],
                       max_entries: int) -> list[int] | None:
    """Greedy: each time, the variable whose table (it and its neighbours) is
    smallest, ties by index; None when even that one exceeds `max_entries`."""
    neighbours: dict[int, set[int]] = {v: set() for v in free}
    for scope in scopes:
        for v in scope:
            neighbours[v].update(scope)
    for v in free:
        neighbours[v].discard(v)

    def size(v: int) -> int:
        return counts[v] * math.prod(counts[u] for u in neighbours[v])

    sizes = {v: size(v) for v in free}
    heap = [(sizes[v], v) for v in free]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        known, v = heapq.heappop(heap)
        if v not in neighbours or known != sizes[v]:
            continue  # eliminated already, or a size since changed
        if known > max_entries:
            return None
        order.append(v)
        around = neighbours.pop(v)
        for u in around:
            neighbours[u].discard(v)
            neighbours[u].update(around - {u})
        for u in around:
            sizes[u] = size(u)
            heapq.heappush(heap, (sizes[u], u))
    return order


def _least(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The minimum over dimension 0 and its first argmin, one candidate at a
    time: `Tensor.min(dim)` costs milliseconds on these small tables (its
    thread pool), a few elementwise comparisons microseconds."""
    best = table[0]
    argbest = torch.zeros(best.shape, dtype=torch.int64)
    for candidate in range(1, table.shape[0]):
        better = table[candidate] < best
        best = torch.where(better, table[candidate], best)
        argbest = torch.where(better, candidate, argbest)
    return best, argbest


def _broadcast(term: _Term, full: tuple[int, ...], counts: Sequence[int]) -> torch.Tensor:
    """`term`'s table viewed over the dimensions `full` (a superset of its scope)."""
    order = sorted(range(len(term.scope)), key=lambda k: full.index(term.scope[k]))
    table = term.table.permute(order) if order != sorted(order) else term.table
    return table.reshape([counts[u] if u in term.scope else 1 for u in full])


def _value_table(problem: Problem, index: int, scope: tuple[int, ...],
                 counts: Sequence[int]) -> torch.Tensor:
    """One value's cost for every combination of its free ends' candidates:
    for each distinct token some reader needs, the cost of making it from what
    the producer makes, paid once however many readers need it (as
    `Problem.value_cost` counts it)."""
    value = problem.values[index]
    ndim = len(scope)
    shape = [counts[v] for v in scope]
    # Per reader: the dimension its candidate varies on (None: fixed) and the
    # token it needs under each candidate.
    readers: list[tuple[int | None, tuple[Hashable, ...]]] = []
    tokens: list[Hashable] = []
    for use in value.uses:
        if use.dst >= 0 and counts[use.dst] > 1:
            reader = (scope.index(use.dst), tuple(use.needs))
        else:
            reader = (None, (use.needs[0],))
        readers.append(reader)
        tokens.extend(token for token in reader[1] if token not in tokens)
    is_free = counts[value.src] > 1
    made_options = value.makes if is_free else (value.makes[0],)
    src_dim = scope.index(value.src) if is_free else None
    total = torch.zeros(shape, dtype=torch.float64)
    for token in tokens:
        wanted = torch.zeros(shape, dtype=torch.bool)
        for dim, needs in readers:
            mask = torch.tensor([need == token for need in needs], dtype=torch.bool)
            wanted = wanted | _along(mask, dim, ndim)
        cost = torch.tensor([0.0 if made == token else value.between(made, token)
                             for made in made_options], dtype=torch.float64)
        total = total + torch.where(wanted, _along(cost, src_dim, ndim),
                                    torch.zeros((), dtype=torch.float64))
    return total


def _along(entries: torch.Tensor, dim: int | None, ndim: int) -> torch.Tensor:
    """Per-candidate entries placed on dimension `dim` of `ndim` for
    broadcasting (None: one constant entry, on no dimension)."""
    shape = [1] * ndim
    if dim is not None:
        shape[dim] = entries.numel()
    return entries.reshape(shape)
