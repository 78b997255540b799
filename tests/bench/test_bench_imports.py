"""The bench modules that tests import into their own process set no
environment variable there: a test process's launches must keep the
environment its standing template started with (the launcher refuses the
template otherwise, and the standing-template tests then fail).
scikit-learn sets KMP_* variables when imported; bench/memory_cap.py once
pulled it in through embedding_cache and the example it trains."""

import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
IMPORTED_BY_TESTS = ["dynamic_job", "dynamic_tables", "hosts", "joined_job", "memory_cap",
                     "ps_memory_cap"]


def test_the_bench_modules_tests_import_set_no_environment_variable():
    # torch._dynamo sets TORCHINDUCTOR_CACHE_DIR: every test process imports
    # it at collection (capture), before its standing template starts.
    code = ("import os, sys, torch._dynamo; sys.path.insert(0, sys.argv[1]); "
            "before = set(os.environ); "
            f"[__import__(m) for m in {IMPORTED_BY_TESTS!r}]; "
            "print(sorted(set(os.environ) - before))")
    done = subprocess.run([sys.executable, "-c", code, str(BENCH)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
