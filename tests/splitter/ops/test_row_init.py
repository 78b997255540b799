"""Row initializers: any row from (seed, table, id) alone, the same on every call."""

import math

import pytest
import torch

from splitrun.splitter.errors import RowInitError
from splitrun.splitter.ops.row_init import (
    normal,
    row_function,
    uniform,
    whole_table,
    xavier_uniform,
    zeros,
)


def test_a_row_depends_only_on_seed_table_and_id():
    init = normal(std=0.5, seed=3)
    whole = whole_table(init, 1000, 8, "item")
    picked = init.rows(torch.tensor([999, 0, 417, 417]), 8, "item")
    assert torch.equal(picked, whole[[999, 0, 417, 417]])
    # Another seed or another table: other rows.
    assert not torch.equal(whole, whole_table(normal(std=0.5, seed=4), 1000, 8, "item"))
    assert not torch.equal(whole, whole_table(init, 1000, 8, "user"))


def test_ids_beyond_any_bound_and_negative_hashed_ids_have_rows():
    init = uniform(-0.1, 0.1, seed=1)
    rows = init.rows(torch.tensor([2**62, -(2**62), 5]), 4, "hashed")
    assert rows.shape == (3, 4) and rows.abs().max() <= 0.1
    assert not torch.equal(rows[0], rows[1])


def test_the_distributions_have_their_moments():
    rows = whole_table(normal(std=2.0, mean=1.0), 50_000, 16, "t")
    assert abs(rows.mean().item() - 1.0) < 0.02 and abs(rows.std().item() - 2.0) < 0.02
    rows = whole_table(uniform(-3.0, 1.0), 50_000, 16, "t")
    assert rows.min() >= -3.0 and rows.max() <= 1.0 and abs(rows.mean().item() + 1.0) < 0.02
    rows = whole_table(xavier_uniform(), 2000, 48, "t")
    bound = math.sqrt(6.0 / (2000 + 48))
    assert rows.abs().max() <= bound and rows.abs().max() > 0.99 * bound
    assert torch.count_nonzero(whole_table(zeros(), 10, 3, "t")) == 0


def test_rows_take_the_table_dtype():
    rows = normal().rows(torch.arange(4), 3, "t", dtype=torch.float16)
    assert rows.dtype == torch.float16
    assert torch.equal(rows, normal().rows(torch.arange(4), 3, "t").to(torch.float16))


def test_a_users_row_function_is_checked_for_its_shape():
    init = row_function(lambda ids: ids.to(torch.float32).reshape(-1, 1).repeat(1, 4))
    assert torch.equal(init.rows(torch.tensor([2, 7]), 4, "t")[:, 0], torch.tensor([2.0, 7.0]))
    with pytest.raises(RowInitError, match=r"table 'item' returned \(2, 3\) for 2 ids; "
                                           r"expected \(2, 4\)"):
        row_function(lambda ids: torch.zeros(len(ids), 3)).rows(torch.tensor([1, 2]), 4, "item")


def test_bad_input_is_named():
    with pytest.raises(RowInitError, match="table 'item': ids must be int64, got torch.float32"):
        normal().rows(torch.tensor([1.0]), 4, "item")
    with pytest.raises(RowInitError, match="xavier_uniform needs the table's row count"):
        xavier_uniform().rows(torch.tensor([1]), 4, "users")
    with pytest.raises(RowInitError, match="low must be below high"):
        uniform(1.0, 1.0)


def test_users_reach_the_initializers_from_the_splitter():
    from splitrun.splitter import RowInit
    assert RowInit.normal(std=0.1, seed=2) == normal(std=0.1, seed=2)
    assert RowInit.function(len).kind == "function"
