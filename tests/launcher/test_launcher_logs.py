"""What `--metrics-dir` writes per step (differences of the executor's counters,
cache hit rates), and the log lines of a launched process: torch's fx advice
dropped. (The files of `--log-dir` and `--metrics-dir`, and a library that logs
as it loads, through the real launcher: tests/e2e/test_launcher_logs_e2e.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from splitrun.runtime.engine.executor import ExecutorStats
from splitrun.runtime.job.metrics import StepMetrics
from splitrun.splitter.labels import Label


def scalars(directory) -> EventAccumulator:
    events = EventAccumulator(str(directory))
    events.Reload()
    return events


def test_step_metrics_are_per_step_differences_and_cache_hit_rates(tmp_path):
    stats = ExecutorStats()
    metrics = StepMetrics(tmp_path, Label.worker(1))
    for step, (sent, waited, hits) in enumerate([(100, 0.5, 3), (250, 0.75, 8)]):
        stats.sent["w1->s0#0"].bytes += sent
        stats.received["s0->w1#0"].bytes += 2 * sent
        stats.received["s0->w1#0"].wait_s += waited
        stats.recv_wait_s += waited
        counters = {"emb": {"last_step": {"hits": hits, "unique_ids": 10, "evictions": step}}}
        metrics.record(step, loss=1.0 / (step + 1), stats=stats, cache_counters=counters)
    metrics.close()
    events = scalars(tmp_path / "worker1")

    def values(tag):
        return [event.value for event in events.Scalars(tag)]
    assert values("loss") == [1.0, 0.5]
    assert values("sent_bytes/w1_to_s0_0") == [100, 250]
    assert values("received_bytes/s0_to_w1_0") == [200, 500]
    assert values("recv_wait_s/s0_to_w1_0") == [0.5, 0.75]
    assert values("cache/emb/hit_rate") == pytest.approx([0.3, 0.8])
    assert values("cache/emb/evictions") == [0, 1]
    assert len(values("steps_per_s")) == 1


def test_torchs_is_fx_tracing_advice_is_not_printed_but_its_loggers_other_lines_are(tmp_path):
    # TorchRec's KeyedJaggedTensor is built through torch.fx's ProxyableClassMeta,
    # which logs that advice once in every process: here a class of that metaclass.
    script = tmp_path / "proxyable.py"
    script.write_text(
        "import logging\n"
        "from torch.fx._symbolic_trace import ProxyableClassMeta\n"
        "class Jagged(metaclass=ProxyableClassMeta):\n"
        "    pass\n"
        "Jagged()\n"
        "logging.getLogger('torch.fx._symbolic_trace').warning('another line of that logger')\n"
        "print('built', flush=True)\n")
    done = subprocess.run([sys.executable, "-m", "splitrun.launcher.bootstrap", str(script)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SPLITRUN_LOG_LEVEL": "WARNING"})
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "built" in output, output
    assert "another line of that logger" in output, output
    assert "is_fx_tracing will return true" not in output, output
