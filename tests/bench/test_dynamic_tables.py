"""bench/dynamic_tables.py --quick: the servers' live rows stay within the row
budget (which it reaches: rows expire by budget as well as by age) and the
counts equal the plain-Python reference's."""

import dynamic_tables


def test_quick_run_holds_the_budget_and_matches_the_reference():
    result = dynamic_tables.run(dynamic_tables.parse(["--quick"]))
    assert result["counts_match_reference"] and result["live_rows_within_budget"]
    assert result["steps_with_different_expired_ids"] == 0
    for server in result["servers"]:
        assert server["expired_by_budget"] > 0 and server["expired"] > server["expired_by_budget"]
        assert server["peak_live_rows"] == result["config"]["row_budget"]
        assert server["dropped_gradients"] > 0
    assert result["distinct_ids"] > 100_000
