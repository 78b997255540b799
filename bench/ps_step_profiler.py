"""The --profile-dir profile of bench/ps_throughput.py: one process's steps
after the warm-up under torch.profiler (aten ops by self CPU time) and
cProfile (the main thread's Python functions), and a breakdown of one step
(receive wait, sends, ops, the rest) from the executor's counters."""

from __future__ import annotations

import cProfile
import io
import json
import pathlib
import pstats

import torch
from ps_bench_model import WARMUP_STEPS

__all__ = ["StepProfiler", "profile_served_steps"]

# Rows of each table kept.
PROFILE_ROWS = 30


def profile_served_steps(process, profiler: StepProfiler) -> None:
    """A server's steps run inside `trainer.finish()`: start the profiler as
    the first step after the warm-up begins."""
    serve_step = process.serve_step

    def serve_and_profile(step: int, **kwargs):
        if step == WARMUP_STEPS:
            profiler.start()
        return serve_step(step, **kwargs)

    process.serve_step = serve_and_profile


class StepProfiler:
    """One process's steps under torch.profiler and cProfile, and the
    executor's counters over the same steps; writes `<process>-ops.txt`,
    `<process>-python.txt` and `<process>-step.json` to `directory`."""

    def __init__(self, directory: pathlib.Path, name: str, stats) -> None:
        self.directory = directory
        self.name = name.replace(" ", "")
        self.stats = stats
        self.torch_profile = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU])
        self.python_profile = cProfile.Profile()
        self._start = None

    def _counters(self) -> dict:
        stats = self.stats
        return {"steps": stats.steps, "step_s": stats.step_s, "recv_wait_s": stats.recv_wait_s,
                "wait_s": {name: c.wait_s for name, c in stats.received.items()}}

    def start(self) -> None:
        self._start = self._counters()
        self.torch_profile.start()
        self.python_profile.enable()

    def stop(self) -> None:
        if self._start is None:
            return
        self.python_profile.disable()
        self.torch_profile.stop()
        end = self._counters()
        steps = end["steps"] - self._start["steps"]
        if steps == 0:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        table = self.torch_profile.key_averages().table(sort_by="self_cpu_time_total",
                                                       row_limit=PROFILE_ROWS)
        (self.directory / f"{self.name}-ops.txt").write_text(f"{steps} steps\n{table}\n")
        text = io.StringIO()
        stats = pstats.Stats(self.python_profile, stream=text)
        stats.sort_stats("tottime").print_stats(PROFILE_ROWS)
        (self.directory / f"{self.name}-python.txt").write_text(f"{steps} steps\n"
                                                                f"{text.getvalue()}")
        ms = lambda seconds: round(seconds * 1000 / steps, 2)  # noqa: E731
        # Main-thread time per step in the transport's send and in aten ops
        # (cProfile's cumulative times).
        cumulative = {(pathlib.Path(path).name, function): row[3]
                      for (path, _, function), row in stats.stats.items()}
        send = cumulative.get(("shm_transport.py", "send"),
                              cumulative.get(("transport.py", "send"), 0.0))
        ops = cumulative.get(("_ops.py", "__call__"), 0.0)
        breakdown = {
            "process": self.name, "steps": steps,
            "step_ms": ms(end["step_s"] - self._start["step_s"]),
            "recv_wait_ms": ms(end["recv_wait_s"] - self._start["recv_wait_s"]),
            "recv_wait_ms_by_channel": {
                name: ms(wait - self._start["wait_s"].get(name, 0.0))
                for name, wait in sorted(end["wait_s"].items())},
            "send_ms": ms(send),
            "ops_ms": ms(ops),
        }
        breakdown["rest_ms"] = round(breakdown["step_ms"] - breakdown["recv_wait_ms"]
                                     - breakdown["send_ms"] - breakdown["ops_ms"], 2)
        (self.directory / f"{self.name}-step.json").write_text(json.dumps(breakdown, indent=2))
