"""bench/dynamic_job.py --quick: a dynamic table trained by a real job (the
launcher, 1 worker, 2 server processes): each server's live rows reach the
row budget and never pass it, and its admitted and expired counts equal the
plain-Python reference's on the same ids, and those of the same job whose
worker caches no row."""

import dynamic_job


def test_quick_job_holds_the_budget_and_matches_the_reference():
    result = dynamic_job.run(dynamic_job.parse(["--quick"]))
    assert result["counts_match_reference"] and result["live_rows_within_budget"]
    budget = result["config"]["row_budget"]
    for server in result["servers"]:
        assert server["peak_live_rows"] == budget and server["live_rows"] <= budget
        assert server["expired_by_budget"] > 0 and server["expired"] > server["expired_by_budget"]
        assert server["peak_rss_mb"] > 0
    assert result["distinct_ids"] > 100_000
    # The worker caches rows (and drops the gradients of ids not admitted,
    # as the servers of the same job caching none do), to the same counts.
    cache = result["worker_cache"]
    assert cache["hits"] > 0 and cache["evictions"] > 0
    assert cache["dropped_gradients"] == result["uncached_dropped_gradients"] > 0
    assert result["uncached_counts_equal"]
