"""The declaration of a dynamic table (splitter/ops/dynamic_table.py)."""

import pytest
import torch

from splitrun.splitter import CaptureError, DynamicTable, EvictionPolicy, RowInit
from splitrun.splitter.capturing.cache_marks import cache_settings_of, place_embedding_cache


def test_place_embedding_cache_marks_a_placeholder_table_dynamic():
    table = torch.nn.EmbeddingBag(1, 8, mode="sum", device="meta")
    policy = DynamicTable(admit_after=3, expire_after_steps=100, row_budget=10_000)
    place_embedding_cache(table, cache_rows=256, init=RowInit.normal(0.01), dynamic=policy)
    settings = cache_settings_of(table)
    assert settings.dynamic == policy and settings.init == RowInit.normal(0.01)
    assert not policy.is_exact and DynamicTable().is_exact
    # A dynamic table's workers cache its rows only when asked; a bounded
    # table's cache is LRU unless told otherwise.
    assert settings.policy is EvictionPolicy.NONE
    place_embedding_cache(table, cache_rows=256, dynamic=policy, policy="lru")
    assert cache_settings_of(table).policy is EvictionPolicy.LRU
    bounded = torch.nn.Embedding(10, 8)
    place_embedding_cache(bounded, cache_rows=4)
    assert cache_settings_of(bounded).policy is EvictionPolicy.LRU


@pytest.mark.parametrize("kwargs, match", [
    ({"admit_after": 0}, "admit_after=0.*>= 1"),
    ({"expire_after_steps": 0}, "expire_after_steps=0"),
    ({"row_budget": -5}, "row_budget=-5"),
    ({"row_budget": 2.5}, "row_budget=2.5.*expected an int"),
])
def test_bad_policies_are_one_line_errors(kwargs, match):
    with pytest.raises(CaptureError, match=match):
        DynamicTable(**kwargs)


def test_dynamic_must_be_a_dynamic_table():
    with pytest.raises(CaptureError, match="takes a DynamicTable, got dict"):
        place_embedding_cache(torch.nn.Embedding(1, 4), cache_rows=4, dynamic={"admit_after": 2})
