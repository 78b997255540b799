"""Where a parameter-server process's CPU time goes, step by step, cheaply
enough to leave on in every measured run (bench/ps_throughput.py).

Per process, CPU milliseconds a step (after the warm-up) in:

- `sends`: the transport's send (over shared memory: the message's copy
  into the peer's ring);
- `tiled_update`: the server's elementwise update run tile by tile
  (`runtime/engine/tiles.py`: the optimizer and the gradients' mean);
- `receives`: the transport's receive, its waits not counted (CPU only);
- `other_threads`: every thread but the main one (over shared memory: a
  ring's reader copying a message it cannot lend in place; gRPC's threads);
- `ops_and_rest`: the main thread's remainder (the step's other ops: a
  worker's forward and backward; the executor's Python).

Wrapped at public names only: the transport object's `send`/`recv` and
`TiledRun.run`; thread times from /proc/self/task (Linux).
"""

from __future__ import annotations

import os
import time

from splitrun.runtime.engine.tiles import TiledRun

__all__ = ["PhaseClock"]


def _thread_cpu_ms() -> dict[int, float]:
    """CPU milliseconds (user + system) of each of this process's threads."""
    ticks = os.sysconf("SC_CLK_TCK")
    times = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        times[int(tid)] = (int(fields[11]) + int(fields[12])) * 1000 / ticks
    return times


class PhaseClock:
    """Counts a process's CPU time by phase once `start()` is called (at the
    first measured step); `per_step(steps)` after the last."""

    def __init__(self, executor) -> None:
        self._on = False
        self._cpu = {"sends": 0.0, "tiled_update": 0.0, "receives": 0.0}
        self._threads_at_start: dict[int, float] = {}
        self._threads_at_end: dict[int, float] | None = None
        self._main_at_start = 0.0
        transport = executor.transport
        transport.send = self._timed("sends", transport.send)
        transport.recv = self._timed("receives", transport.recv, cpu_only=True)
        run = TiledRun.run
        clock = self

        def timed_run(self_run, env):
            if not clock._on:
                return run(self_run, env)
            started = time.thread_time()
            try:
                return run(self_run, env)
            finally:
                clock._cpu["tiled_update"] += time.thread_time() - started

        TiledRun.run = timed_run

    def _timed(self, phase: str, function, cpu_only: bool = False):
        def timed(*args, **kwargs):
            if not self._on:
                return function(*args, **kwargs)
            started = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self._cpu[phase] += time.thread_time() - started
        return timed

    def start(self) -> None:
        self._threads_at_start = _thread_cpu_ms()
        self._main_at_start = time.thread_time()
        self._on = True

    def stop(self) -> None:
        """The end of the measured steps (before the job's finish)."""
        if self._on and self._threads_at_end is None:
            self._threads_at_end = _thread_cpu_ms()
            self._main_s = time.thread_time() - self._main_at_start
            self._on = False

    def per_step(self, steps: int) -> dict[str, float]:
        self.stop()
        main = os.getpid()
        others = sum(ms - self._threads_at_start.get(tid, 0.0)
                     for tid, ms in self._threads_at_end.items() if tid != main)
        phases = {name: seconds * 1000 for name, seconds in self._cpu.items()}
        phases["other_threads"] = others
        phases["ops_and_rest"] = self._main_s * 1000 - sum(self._cpu.values()) * 1000
        return {name: round(ms / steps, 2) for name, ms in phases.items()}
