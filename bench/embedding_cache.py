"""Embedding cache: hit rates of its eviction policies, and what caching buys a
recommendation job. Prints JSON.

(a) Hit rates. `RowCache.plan()` (the worker's cache of one table, exactly as
    the runtime drives it, write-back, no servers) is fed independent Zipf
    draws over a 1 M-row table, for exponents 0.9, 1.05, 1.2 and caches of 1 %,
    5 %, 20 % of the rows, LRU and LFU, next to the ideal static cache (the
    most frequent rows, always cached): all on the same id streams, measured
    on the same batches, after the cache is full and a warm-up. Per-lookup hit
    rate: a lookup hits when its id was cached before its batch (what theory
    speaks of; Che's approximation for LRU is reported next to it). Per-unique
    id: of a batch's distinct ids, those served without a pull (what the
    runtime's counters report). Goals, at exponent 1.05 and 5 %: LFU within
    0.02 and LRU within 0.06 of the ideal static cache (per lookup).

(b) Throughput. The DLRM job of examples/recsys_cache.py through the real
    launcher (1 worker, 2 servers; the MLPs on the worker, the tables' rows on
    the servers), with LRU caches against the same job with policy none
    (every lookup pulls its rows from the servers and every gradient goes
    back) and with the whole tables cached (the ceiling: no misses once
    warm); next to them, in the same run, on the same model, starting
    weights and batches, what users would run instead (bench/torchrec_anchors.py):
    plain torch in one process, TorchRec's FusedEmbeddingBagCollection in one
    process, TorchRec's DistributedModelParallel on 2 processes (gloo).
    Interleaved, median of --repeats runs; samples/s over the steps after a
    warm-up (the cache is full by then) and over the whole run; every ratio
    of a splitrun job to an anchor; for the splitrun jobs also the ms a step
    blocked for rows and the share of table steps whose plan (evict, write
    back, pull, install) was made while the step before computed. Goals (one
    host): the LRU 20 % cache at
    least 1.0x DMP's samples/s, the whole-table-cached job at least 1.0x the
    fused collection's, the LRU 20 % cache at least 0.9x the whole-table
    ceiling. The three splitrun jobs then run across two simulated hosts
    (bench/hosts.py, needs root): scheduler and servers on one side of a
    link shaped to 10 Gbit/s, then 1 Gbit/s, the worker on the other.

(c) Profile (only with --part profile): the three jobs of (b) on one host,
    the steps after the warm-up: worker 0's under torch.profiler (aten ops
    by self CPU time) and cProfile, with the CPU time a step of its step's
    thread, of its whole process and of each of its threads (the plan made
    ahead, the transport's threads); server 0's table store (the requests of those steps, in its
    serving thread) the same way; the tables go to
    --profile-dir/<job>/{worker0,server0}/ (--variants: only those jobs).

    python bench/embedding_cache.py [--quick] [--repeats 3] [--one-host]
        [--rates-mbit 10000 1000] [--part hit_rates|throughput|profile]
        [--variants lru_20_percent ...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pathlib
import platform
import pstats
import resource
import statistics
import subprocess
import sys
import threading
import time

import torch

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "examples"))

import recsys_cache  # noqa: E402

from splitrun.runtime.engine.embedding.row_cache import RowCache  # noqa: E402
from splitrun.splitter import CachedTable, CacheSettings, EvictionPolicy  # noqa: E402

# -- (a) hit rates -------------------------------------------------------------

SIM_ROWS = 1_000_000
ZIPF_EXPONENTS = (0.9, 1.05, 1.2)
CACHE_FRACTIONS = (0.01, 0.05, 0.20)
SIM_BATCH = 1024  # lookups per batch
# Batches simulated after the cache first fills, before measuring: LRU is in
# its steady state as soon as it is full; LFU's counts keep sharpening, and
# this many batches (about 1 M lookups) is about what a short job sees.
WARMUP_AFTER_FULL_BATCHES = 1000
MEASURED_BATCHES = 2000
QUICK_WARMUP_AFTER_FULL_BATCHES = 200
QUICK_MEASURED_BATCHES = 300
# Streams are drawn in chunks of this many batches until long enough.
STREAM_CHUNK_BATCHES = 1000
SIM_SEED = 0
GOAL_ZIPF = 1.05
GOAL_FRACTION = 0.05
GOAL_LFU_GAP = 0.02
GOAL_LRU_GAP = 0.06
# Bisection steps for Che's characteristic time (float64 converges well before).
CHE_BISECTION_STEPS = 200


def zipf_probabilities(num_rows: int, exponent: float) -> torch.Tensor:
    weights = torch.arange(1, num_rows + 1, dtype=torch.float64).pow_(-exponent)
    return weights / weights.sum()


def che_lru_hit_rate(probabilities: torch.Tensor, capacity: int) -> float:
    """Che's approximation of LRU's hit rate under independent draws: the
    characteristic time T solves sum_i (1 - exp(-p_i T)) = C, and the hit
    rate is sum_i p_i (1 - exp(-p_i T))."""
    def occupancy(t: float) -> float:
        return float((-torch.expm1(-probabilities * t)).sum())
    low, high = 0.0, 1.0
    while occupancy(high) < capacity:
        high *= 2
    for _ in range(CHE_BISECTION_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if occupancy(middle) < capacity else (low, middle)
    return float((probabilities * -torch.expm1(-probabilities * high)).sum())


class IdStream:
    """One exponent's id stream, batch by batch, drawn as the example draws
    its ids (Zipf ranks mapped to ids by a fixed permutation), extended on
    demand; also knows after which batch the stream has shown C distinct ids
    (when a cache of C rows, which evicts only when full, fills)."""

    def __init__(self, exponent: float, num_rows: int, batch: int, seed: int) -> None:
        self.exponent = exponent
        self.num_rows = num_rows
        self.batch = batch
        self.generator = torch.Generator().manual_seed(seed)
        self.order = recsys_cache.hot_order(num_rows, 0)
        self.chunks: list[torch.Tensor] = []
        self.seen = torch.zeros(num_rows, dtype=torch.bool)
        self.distinct_after: list[torch.Tensor] = []  # cumulative distinct ids per batch

    @property
    def num_batches(self) -> int:
        return sum(c.shape[0] for c in self.chunks)

    def extend(self, num_batches: int) -> None:
        ranks = recsys_cache.zipf_ranks(self.num_rows, self.exponent,
                                        num_batches * self.batch, self.generator)
        ids = self.order[ranks]
        unique, inverse = torch.unique(ids, return_inverse=True)
        first = torch.full((unique.numel(),), ids.numel(), dtype=torch.int64)
        first.scatter_reduce_(0, inverse, torch.arange(ids.numel()), reduce="amin")
        new = ~self.seen[unique]
        self.seen[unique] = True
        per_batch = torch.bincount(first[new] // self.batch, minlength=num_batches)
        before = self.distinct_after[-1][-1] if self.distinct_after else torch.tensor(0)
        self.distinct_after.append(before + torch.cumsum(per_batch, 0))
        self.chunks.append(ids.reshape(num_batches, self.batch))

    def fill_batch(self, capacity: int) -> int:
        """Index of the batch after which `capacity` distinct ids were seen."""
        while not self.distinct_after or int(self.distinct_after[-1][-1]) < capacity:
            self.extend(STREAM_CHUNK_BATCHES)
        distinct = torch.cat(self.distinct_after)
        return int(torch.searchsorted(distinct, capacity))

    def batches(self, end: int) -> torch.Tensor:
        while self.num_batches < end:
            self.extend(STREAM_CHUNK_BATCHES)
        return torch.cat(self.chunks)[:end]


def simulate(policy: EvictionPolicy, ids: torch.Tensor, capacity: int, num_rows: int,
             window: range) -> dict:
    """Drive `RowCache.plan()` through every batch; count hits in `window`."""
    table = CachedTable("sim.weight", num_rows, 1, torch.float32,
                        CacheSettings(capacity, policy), "sgd", {}, (), None)
    cache = RowCache(table)
    lookup_hits = unique_hits = unique_total = 0
    started = time.perf_counter()
    for step in range(window.stop):
        batch = ids[step]
        if step in window:
            lookup_hits += int((cache.slots_or_missing(batch) >= 0).sum())
        plan = cache.plan(batch, step, write_back=True, max_staleness=0)
        if step in window:
            unique_total += plan.num_unique
            unique_hits += plan.num_unique - plan.pull_ids.numel()
    return {"per_lookup": lookup_hits / (len(window) * ids.shape[1]),
            "per_unique_id": unique_hits / unique_total,
            "seconds": time.perf_counter() - started}


def ideal_static(ids: torch.Tensor, hottest: torch.Tensor, num_rows: int,
                 window: range) -> dict:
    """The most frequent rows always cached, measured on the same batches."""
    cached = torch.zeros(num_rows, dtype=torch.bool)
    cached[hottest] = True
    measured = ids[window.start:window.stop]
    unique_hits = unique_total = 0
    for batch in measured:
        unique = torch.unique(batch)
        unique_hits += int(cached[unique].sum())
        unique_total += unique.numel()
    return {"per_lookup": float(cached[measured].float().mean()),
            "per_unique_id": unique_hits / unique_total}


def hit_rates(quick: bool) -> dict:
    warmup = QUICK_WARMUP_AFTER_FULL_BATCHES if quick else WARMUP_AFTER_FULL_BATCHES
    measured = QUICK_MEASURED_BATCHES if quick else MEASURED_BATCHES
    results = []
    for exponent in ZIPF_EXPONENTS:
        stream = IdStream(exponent, SIM_ROWS, SIM_BATCH, SIM_SEED)
        probabilities = zipf_probabilities(SIM_ROWS, exponent)
        for fraction in CACHE_FRACTIONS:
            capacity = round(fraction * SIM_ROWS)
            filled = stream.fill_batch(capacity) + 1
            window = range(filled + warmup, filled + warmup + measured)
            ids = stream.batches(window.stop)
            lru = simulate(EvictionPolicy.LRU, ids, capacity, SIM_ROWS, window)
            lfu = simulate(EvictionPolicy.LFU, ids, capacity, SIM_ROWS, window)
            ideal = ideal_static(ids, stream.order[:capacity], SIM_ROWS, window)
            results.append({
                "zipf": exponent, "cache_fraction": fraction, "cache_rows": capacity,
                "cache_full_after_batch": filled, "measured_batches": [window.start, window.stop],
                "per_lookup": {"lru": round(lru["per_lookup"], 4),
                               "lfu": round(lfu["per_lookup"], 4),
                               "ideal_static": round(ideal["per_lookup"], 4),
                               "lru_che_approximation": round(
                                   che_lru_hit_rate(probabilities, capacity), 4),
                               "ideal_static_expected": round(
                                   float(probabilities[:capacity].sum()), 4)},
                "per_unique_id": {"lru": round(lru["per_unique_id"], 4),
                                  "lfu": round(lfu["per_unique_id"], 4),
                                  "ideal_static": round(ideal["per_unique_id"], 4)},
                "lru_below_ideal": round(ideal["per_lookup"] - lru["per_lookup"], 4),
                "lfu_below_ideal": round(ideal["per_lookup"] - lfu["per_lookup"], 4),
                "simulation_s": {"lru": round(lru["seconds"], 1),
                                 "lfu": round(lfu["seconds"], 1)}})
    goal = next(r for r in results
                if r["zipf"] == GOAL_ZIPF and r["cache_fraction"] == GOAL_FRACTION)
    return {"table_rows": SIM_ROWS, "batch_lookups": SIM_BATCH,
            "warmup_batches_after_full": warmup, "measured_batches": measured,
            "results": results,
            "goals": {"at": {"zipf": GOAL_ZIPF, "cache_fraction": GOAL_FRACTION},
                      "lfu_within": GOAL_LFU_GAP, "lfu_below_ideal": goal["lfu_below_ideal"],
                      "lfu_met": goal["lfu_below_ideal"] <= GOAL_LFU_GAP,
                      "lru_within": GOAL_LRU_GAP, "lru_below_ideal": goal["lru_below_ideal"],
                      "lru_met": goal["lru_below_ideal"] <= GOAL_LRU_GAP}}


# -- (b) throughput ----------------------------------------------------------------

# The job: 8 tables of 250 k rows, 128-wide rows (MLPerf DLRM's width), a
# global batch of 1,024 with 16 ids per sample and table (multi-hot, pooled):
# 16,384 lookups per table and step. Zipf 1.05, plain SGD (DLRM's reference
# optimizer; Adagrad's sums would travel with every cached row too). Small
# MLPs, so the step is mostly the embedding rows: their lookups, traffic and
# updates.
THROUGHPUT_JOB = ["--tables", "8", "--rows", "250000", "--dim", "128", "--batch-size", "1024",
                  "--ids-per-table", "16", "--bottom", "64", "--top", "64", "--zipf", "1.05",
                  "--optimizer", "sgd"]
# What is compared: LRU caches of 20 % of each table; no caching (every lookup
# to the servers: the baseline); and the whole table cached (no misses once
# warm: the most any cache can buy here, so what bounds the speedup).
VARIANTS = {"lru_20_percent": ["--policy", "lru", "--cache-fraction", "0.2"],
            "none": ["--policy", "none"],
            "whole_table_cached": ["--policy", "lru", "--cache-fraction", "1.0"]}
CACHED, UNCACHED, CEILING = VARIANTS
THROUGHPUT_WORKERS = 1
THROUGHPUT_SERVERS = 2
# Steps before timing starts (the 20 % caches are full after ~10 steps) and
# steps timed.
WARMUP_STEPS = 30
MEASURED_STEPS = 60
QUICK_WARMUP_STEPS = 15
QUICK_MEASURED_STEPS = 20
# What users would run instead (bench/torchrec_anchors.py), on the same job.
ANCHORS = {"torch_one_process": "plain", "torchrec_fused_one_process": "fused",
           "torchrec_dmp_2_processes": "dmp"}
TORCH, FUSED, DMP = ANCHORS
DMP_PROCESSES = 2
# Goals on one host: (numerator, denominator, at least).
GOALS = {"lru_20_percent_vs_torchrec_dmp": (CACHED, DMP, 1.0),
         "whole_table_cached_vs_torchrec_fused": (CEILING, FUSED, 1.0),
         "lru_20_percent_vs_whole_table_cached": (CACHED, CEILING, 0.9)}
# The goals of the two-host runs (at 10 Gbit/s): the cache at least 3x the
# uncached job, and at least this share of the ceiling.
GOAL_SPEEDUP = 3.0
GOAL_OF_CEILING = 0.85
# Bounds one launched job (start, data, steps, shutdown) on 2 cores.
RUN_TIMEOUT_S = 900
BENCH_PREFIX = "BENCH "
# Each server's line at the end: its peak RSS and the rows its store made.
MEMORY_PREFIX = "SERVER_MEMORY "
# --part profile: steps profiled after the warm-up, and rows of each table kept.
PROFILED_STEPS = 10
PROFILE_ROWS = 25


def run_job(args: argparse.Namespace) -> None:
    """Runs inside `splitrun launch`: every process runs this. Worker 0 prints
    one line BENCH {...}: when each step ended, and the cache counters."""
    from splitrun.runtime.job import Job

    job_args = recsys_cache.parser().parse_args(args.job_args)
    torch.set_num_threads(job_args.threads)
    job = Job.from_env()
    _, program, spec, _, _ = recsys_cache.build(job_args, job.cluster.num_workers,
                                                tables_here=not job.is_worker)
    batches = []
    if job.is_worker:
        hidden = recsys_cache.HiddenModel.build(spec)
        batches = recsys_cache.global_batches(spec, hidden, job_args.batch_size, job_args.steps)
    # No final state by default: the whole tables' dump is no part of a
    # training step. `--final-state gather`: worker 0 receives it whole;
    # `views`: into a sharded checkpoint, the tables handed back as views.
    trainer = job.start(program, recsys_cache.cache_mode(job_args),
                        gather_state=args.final_state != "none")
    profiler = _StepProfiler(pathlib.Path(args.profile_dir) / "worker0", args.profile_after) if (
        args.profile_dir and job.is_driver) else None
    if args.profile_dir and job.label.role.value == "server" and job.rank == 0:
        trainer.process.set_store_hook(_StoreProfiler(
            pathlib.Path(args.profile_dir) / "server0", args.profile_after).on_request)
    stamps = [time.perf_counter()]
    waits = []  # seconds blocked for rows so far, after each step
    # Each thread's scheduler times once the warm-up ends (either length) and
    # at the end: what the timed steps cost the step's thread and the others.
    threads = {"step_thread": threading.get_native_id(), "after_steps": {}}
    for step, _ in enumerate(trainer.run(trainer.shard(batches))):
        stamps.append(time.perf_counter())
        waits.append(trainer.process.cache_waits)
        if job.is_driver and step + 1 in (QUICK_WARMUP_STEPS, WARMUP_STEPS):
            threads["after_steps"][step + 1] = threads_sched_ns()
        if profiler is not None:
            profiler.after_step(step)
    if profiler is not None:
        profiler.stop()
    if job.is_driver:
        threads["after_steps"][len(stamps) - 1] = threads_sched_ns()
    finished = time.perf_counter()
    views = args.final_state == "views"
    final_state = trainer.finish(save_to=args.final_dir if views else None,
                                 gather_tables_up_to=0 if views else None)
    if job.label.role.value == "server":  # a server serves the steps within finish()
        rows_made = trainer.process.store_rows
        print(MEMORY_PREFIX + json.dumps({
            "server": job.rank, "peak_rss_mb": round(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "rows_made": sum(made for made, _ in rows_made.values()),
            "shard_rows": sum(rows for _, rows in rows_made.values())}), flush=True)
    if job.is_driver:
        counters = trainer.cache_counters.values()
        print(BENCH_PREFIX + json.dumps({
            "final_state": args.final_state, "finish_s": time.perf_counter() - finished,
            "final_state_mb": _final_state_mb(final_state),
            "views": sorted(k for k, v in (final_state or {}).items()
                            if not isinstance(v, torch.Tensor)),
            "stamps": stamps, "waits": waits, "threads": threads,
            "hits": sum(c["hits"] for c in counters),
            "unique_ids": sum(c["unique_ids"] for c in counters),
            "bytes_pulled": sum(c["bytes_pulled"] for c in counters),
            "bytes_pushed": sum(c["bytes_pushed"] for c in counters),
            "table_steps_planned_ahead": sum(c["planned_ahead"] for c in counters),
            "table_steps": len(counters) * len(stamps[1:])}), flush=True)


def _final_state_mb(state: dict | None) -> float:
    """What the final state holds in memory on worker 0 (views: nothing)."""
    tensors = [v for v in (state or {}).values() if isinstance(v, torch.Tensor)]
    return round(sum(t.numel() * t.element_size() for t in tensors) / 2**20, 1)


class _StepProfiler:
    """Worker 0's steps after `after` (the cache is warm by then), under
    torch.profiler (ops: self CPU time) and cProfile (Python functions); the
    tables are written to `directory` when it stops."""

    def __init__(self, directory: pathlib.Path, after: int) -> None:
        self.directory = directory
        self.after = after
        self.torch_profile = torch.profiler.profile(activities=[
            torch.profiler.ProfilerActivity.CPU])
        self.python_profile = cProfile.Profile()
        self.steps = 0
        self.started_cpu_s = self.started_process_s = 0.0
        self.started_threads: dict[int, int] = {}

    def after_step(self, step: int) -> None:
        if step + 1 == self.after:
            self.torch_profile.start()
            self.python_profile.enable()
            self.started_threads = _threads_cpu_ns()
            self.started_cpu_s = time.thread_time()
            self.started_process_s = _process_cpu_s()
        elif step + 1 > self.after:
            self.steps += 1

    def stop(self) -> None:
        if self.steps == 0:
            return
        cpu_ms = 1e3 * (time.thread_time() - self.started_cpu_s) / self.steps
        process_ms = 1e3 * (_process_cpu_s() - self.started_process_s) / self.steps
        threads = _threads_ms_per_step(self.started_threads, _threads_cpu_ns(), process_ms,
                                       self.steps)
        self.python_profile.disable()
        self.torch_profile.stop()
        self.directory.mkdir(parents=True, exist_ok=True)
        table = self.torch_profile.key_averages().table(sort_by="self_cpu_time_total",
                                                       row_limit=PROFILE_ROWS)
        (self.directory / "ops.txt").write_text(
            f"{self.steps} steps; the step's thread's CPU time: {cpu_ms:.1f} ms a step; the "
            f"whole worker process (the plan made ahead, the transport's threads too): "
            f"{process_ms:.1f} ms a step\nCPU ms a step by thread: {json.dumps(threads)}\n"
            f"{table}\n")
        text = io.StringIO()
        stats = pstats.Stats(self.python_profile, stream=text)
        stats.sort_stats("tottime").print_stats(PROFILE_ROWS)
        (self.directory / "python.txt").write_text(f"{self.steps} steps\n{text.getvalue()}")


class _StoreProfiler:
    """Server 0's table store over the requests of steps [after, after +
    PROFILED_STEPS), in its serving thread (`set_store_hook`): the same two
    tables as the worker's, and the store's CPU time per step."""

    def __init__(self, directory: pathlib.Path, after: int) -> None:
        self.directory = directory
        self.after = after
        self.torch_profile = None
        self.python_profile = cProfile.Profile()
        self.started_cpu_s = self.started_process_s = 0.0
        self.started_threads: dict[int, int] = {}
        self.done = False

    def on_request(self, step: int) -> None:
        if self.done or step < self.after:
            return
        if self.torch_profile is None:
            self.torch_profile = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU])
            self.torch_profile.start()
            self.python_profile.enable()
            self.started_threads = _threads_cpu_ns()
            self.started_cpu_s = time.thread_time()
            self.started_process_s = _process_cpu_s()
        elif step >= self.after + PROFILED_STEPS:
            cpu_s = time.thread_time() - self.started_cpu_s
            process_s = _process_cpu_s() - self.started_process_s
            threads = _threads_ms_per_step(self.started_threads, _threads_cpu_ns(),
                                           1e3 * process_s / PROFILED_STEPS, PROFILED_STEPS,
                                           this_thread="serving thread")
            self.python_profile.disable()
            self.torch_profile.stop()
            self.done = True
            self.directory.mkdir(parents=True, exist_ok=True)
            table = self.torch_profile.key_averages().table(sort_by="self_cpu_time_total",
                                                           row_limit=PROFILE_ROWS)
            (self.directory / "ops.txt").write_text(
                f"{PROFILED_STEPS} steps; the serving thread's CPU time: {cpu_s:.3f} s "
                f"({1e3 * cpu_s / PROFILED_STEPS:.1f} ms a step); the whole server process "
                f"(its plan step too): {1e3 * process_s / PROFILED_STEPS:.1f} ms a step"
                f"\nCPU ms a step by thread: {json.dumps(threads)}\n{table}\n")
            text = io.StringIO()
            pstats.Stats(self.python_profile, stream=text).sort_stats("tottime").print_stats(
                PROFILE_ROWS)
            (self.directory / "python.txt").write_text(f"{PROFILED_STEPS} steps\n{text.getvalue()}")


def threads_sched_ns() -> dict[int, tuple[int, int]]:
    """(CPU time, time runnable but waiting for a core) in ns, the
    scheduler's counts, of each live thread of this process."""
    times = {}
    for task in pathlib.Path("/proc/self/task").iterdir():
        try:
            ran, waited, _ = (task / "schedstat").read_text().split()
            times[int(task.name)] = (int(ran), int(waited))
        except (OSError, ValueError):
            continue  # ended meanwhile
    return times


def _threads_cpu_ns() -> dict[int, int]:
    """CPU time (ns, the scheduler's count) of each live thread of this process."""
    return {tid: ran for tid, (ran, _) in threads_sched_ns().items()}


def _threads_ms_per_step(before: dict[int, int], after: dict[int, int], process_ms: float,
                         steps: int, this_thread: str = "step thread") -> dict[str, float]:
    """CPU ms a step of each thread alive at the end (by its Python name, or
    its native id), and of the threads that ended meanwhile (the rest of the
    process's time)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    # Called in the step's (or serving) thread (a forked process's main
    # thread keeps its parent's native id in `threading`).
    names[threading.get_native_id()] = this_thread
    result: dict[str, float] = {}
    for tid, ns in after.items():
        name = names.get(tid, f"native-{tid}")
        result[name] = round(result.get(name, 0.0) + (ns - before.get(tid, 0)) / 1e6 / steps, 2)
    result["threads ended meanwhile"] = round(process_ms - sum(result.values()), 2)
    return dict(sorted(result.items(), key=lambda item: -item[1]))


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def launch(variant: str, steps: int, profile_dir: str | None = None,
           profile_after: int = 0, *, script: pathlib.Path = HERE,
           env: dict[str, str] | None = None) -> dict:
    """One run of the job's `variant` through the launcher: its BENCH record.
    `script`: this file of another checkout (bench/commit_ab.py), with the
    `env` that imports that checkout's splitrun."""
    profile = ["--profile-dir", profile_dir, "--profile-after", str(profile_after)] if (
        profile_dir) else []
    command = [sys.executable, "-m", "splitrun.launcher", "--log-level", "WARNING", "launch",
               "--workers", str(THROUGHPUT_WORKERS), "--servers", str(THROUGHPUT_SERVERS),
               "--device", "cpu", str(script), "--job", *profile, "--",
               *THROUGHPUT_JOB, *VARIANTS[variant], "--steps", str(steps)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                         env=env)
    for line in out.stdout.splitlines():
        if BENCH_PREFIX in line:
            return json.loads(line.split(BENCH_PREFIX, 1)[1])
    raise RuntimeError(f"the {variant} job ({script}) failed ({out.returncode}):\n"
                       f"{out.stdout[-4000:]}\n{out.stderr[-4000:]}")


def launch_anchor(anchor: str, steps: int) -> dict:
    """One run of an anchor (bench/torchrec_anchors.py) on the same job; DMP's
    processes meet at a TCPStore this process serves (port 0)."""
    import datetime

    import torch.distributed as dist

    script = str(HERE.parent / "torchrec_anchors.py")
    job = [*THROUGHPUT_JOB, "--steps", str(steps)]
    kind = ANCHORS[anchor]
    if kind != "dmp":
        commands, store = [[sys.executable, script, kind, "--", *job]], None
    else:
        store = dist.TCPStore("127.0.0.1", 0, DMP_PROCESSES + 1, is_master=True,
                              wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=RUN_TIMEOUT_S))
        commands = [[sys.executable, script, kind, "--rank", str(rank), "--world-size",
                     str(DMP_PROCESSES), "--store", f"127.0.0.1:{store.port}", "--", *job]
                    for rank in range(DMP_PROCESSES)]
    processes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for c in commands]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=RUN_TIMEOUT_S)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    del store
    for output in outputs:
        for line in output.splitlines():
            if line.startswith(BENCH_PREFIX):
                return json.loads(line[len(BENCH_PREFIX):])
    raise RuntimeError(f"the {anchor} run failed:\n" + "\n".join(o[-4000:] for o in outputs))


# -- across two simulated hosts (bench/hosts.py) --------------------------------

# Link rates of the two-host runs (Mbit/s): 10 and 1 Gbit/s.
TWO_HOST_RATES_MBIT = (10_000, 1_000)


def _job_command(variant: str, steps: int) -> list[str]:
    return [str(HERE), "--job", "--", *THROUGHPUT_JOB, *VARIANTS[variant], "--steps", str(steps)]


def _bench_result(path: pathlib.Path) -> dict:
    for line in path.read_text(errors="replace").splitlines():
        if BENCH_PREFIX in line:
            return json.loads(line.split(BENCH_PREFIX, 1)[1])
    raise RuntimeError(f"no {BENCH_PREFIX.strip()} line in {path}:\n"
                       f"{path.read_text(errors='replace')[-4000:]}")


def launch_two_hosts(hosts, workdir: pathlib.Path, variant: str, steps: int) -> dict:
    """Scheduler and the servers on host a, the worker on host b: every pull,
    write-back and gradient crosses the shaped link."""
    from joined_job import run_joined_job

    run_dir = workdir / f"{variant}-{time.monotonic_ns()}"
    run_dir.mkdir()
    logs = run_joined_job(hosts, run_dir, workers=THROUGHPUT_WORKERS,
                          servers=THROUGHPUT_SERVERS, job_command=_job_command(variant, steps),
                          what=variant, timeout_s=RUN_TIMEOUT_S)
    return _bench_result(logs[THROUGHPUT_SERVERS])


def samples_per_s(stamps: list[float], first_step: int, batch_size: int) -> float:
    """Global samples per second over the steps from `first_step` on."""
    return (len(stamps) - 1 - first_step) * batch_size / (stamps[-1] - stamps[first_step])


def summarize(measured: list[dict], warmup: int, steps: int, batch_size: int) -> dict:
    """Medians over the runs of one variant."""
    steady = [samples_per_s(r["stamps"], warmup, batch_size) for r in measured]
    whole = [samples_per_s(r["stamps"], 0, batch_size) for r in measured]
    median = statistics.median
    summary = {"samples_per_s": round(median(steady), 1),
               "step_ms": round(1e3 * batch_size / median(steady), 1),
               "samples_per_s_whole_run": round(median(whole), 1),
               "runs_samples_per_s": [round(s, 1) for s in steady]}
    if "hits" not in measured[0]:  # an anchor
        return summary
    return {**summary,
            "hit_rate_per_unique_id_whole_run": round(median(
                r["hits"] / r["unique_ids"] for r in measured), 4),
            "mb_pulled_per_step": round(median(r["bytes_pulled"] for r in measured)
                                        / steps / 1e6, 2),
            "mb_pushed_per_step": round(median(r["bytes_pushed"] for r in measured)
                                        / steps / 1e6, 2),
            "ms_blocked_for_rows_per_step": _blocked(measured, warmup),
            "worker_threads_ms_per_step": _thread_times(measured, warmup),
            "share_planned_ahead": round(median(r["table_steps_planned_ahead"] / r["table_steps"]
                                                for r in measured), 4)}


def _thread_times(measured: list[dict], warmup: int) -> dict:
    """Medians over the runs, ms per timed step of the worker's threads: the
    step's thread on a core and runnable but waiting for one (the cores
    shared with the servers and the planning thread), and the worker's other
    threads on a core (planning ahead, the transport)."""
    per_run = []
    for run in measured:
        steps = len(run["stamps"]) - 1
        start = {int(t): v for t, v in run["threads"]["after_steps"][str(warmup)].items()}
        end = {int(t): v for t, v in run["threads"]["after_steps"][str(steps)].items()}
        main = run["threads"]["step_thread"]
        others = sum(end[t][0] - start[t][0] for t in end if t in start and t != main)
        per_run.append([(end[main][0] - start[main][0]) / (steps - warmup),
                        (end[main][1] - start[main][1]) / (steps - warmup),
                        others / (steps - warmup)])
    return {name: round(statistics.median(r[i] for r in per_run) / 1e6, 2)
            for i, name in enumerate(("step_thread_cpu", "step_thread_waiting_for_a_core",
                                      "other_threads_cpu"))}


def _blocked(measured: list[dict], warmup: int) -> dict:
    """Medians over the runs of the ms a timed step blocked waiting for
    prefetched rows (what the next-batch prefetch, or the next step's plan
    made while a step computes, did not hide) and for rows pulled in the step
    itself, and the share of the step the first is."""
    result = {}
    for kind in ("prefetched", "pulled"):
        result[kind] = round(1e3 * statistics.median(
            (r["waits"][-1][kind] - r["waits"][warmup - 1][kind]) / (len(r["waits"]) - warmup)
            for r in measured), 3)
    step_ms = statistics.median(1e3 * (r["stamps"][-1] - r["stamps"][warmup])
                                / (len(r["stamps"]) - 1 - warmup) for r in measured)
    result["prefetched_share_of_step"] = round(result["prefetched"] / step_ms, 4)
    return result


def _ratios(results: dict[str, dict]) -> dict:
    """Every splitrun job's samples/s over every anchor's, and the goals."""
    rate = {name: result["samples_per_s"] for name, result in results.items()}
    ratios = {f"{v}_vs_{a}": round(rate[v] / rate[a], 3) for v in VARIANTS for a in ANCHORS}
    ratios.update({f"{a}_vs_{b}": round(rate[a] / rate[b], 3)
                   for a, b in ((FUSED, TORCH), (DMP, TORCH), (DMP, FUSED))})
    goals = {}
    for name, (a, b, bound) in GOALS.items():
        # Also per repeat: the two jobs ran in the same round, minutes apart,
        # so drift of the machine between rounds cancels out of their ratio.
        paired = [x / y for x, y in zip(results[a]["runs_samples_per_s"],
                                         results[b]["runs_samples_per_s"])]
        goals[name] = {"ratio": round(rate[a] / rate[b], 3), "at_least": bound,
                       "met": rate[a] / rate[b] >= bound,
                       "ratios_per_round": [round(r, 3) for r in paired],
                       "median_per_round": round(statistics.median(paired), 3)}
    return {"ratios": ratios, "goals": goals}


def _compare(runs: dict[str, list[dict]], warmup: int, steps: int, batch_size: int) -> dict:
    results = {v: summarize(r, warmup, steps, batch_size) for v, r in runs.items()
               if v in VARIANTS}
    speedup = results[CACHED]["samples_per_s"] / results[UNCACHED]["samples_per_s"]
    of_ceiling = results[CACHED]["samples_per_s"] / results[CEILING]["samples_per_s"]
    return {"results": results,
            "speedup": round(speedup, 3),
            "speedup_whole_run": round(results[CACHED]["samples_per_s_whole_run"]
                                       / results[UNCACHED]["samples_per_s_whole_run"], 3),
            "speedup_ceiling_whole_table_cached": round(
                results[CEILING]["samples_per_s"] / results[UNCACHED]["samples_per_s"], 3),
            "cached_of_ceiling": round(of_ceiling, 3),
            "goal_speedup_at_least": GOAL_SPEEDUP, "goal_met": speedup >= GOAL_SPEEDUP,
            "goal_of_ceiling_at_least": GOAL_OF_CEILING,
            "goal_of_ceiling_met": of_ceiling >= GOAL_OF_CEILING}


def throughput(quick: bool, repeats: int, rates_mbit: tuple[float, ...]) -> dict:
    """One host (loopback and shared memory), then, for each rate, servers and
    worker on two simulated hosts joined by a link shaped to that rate."""
    warmup = QUICK_WARMUP_STEPS if quick else WARMUP_STEPS
    steps = warmup + (QUICK_MEASURED_STEPS if quick else MEASURED_STEPS)
    batch_size = int(THROUGHPUT_JOB[THROUGHPUT_JOB.index("--batch-size") + 1])
    runs: dict[str, list[dict]] = {name: [] for name in [*VARIANTS, *ANCHORS]}
    for _ in range(repeats):  # interleaved, so drift hits every variant alike
        for variant in VARIANTS:
            runs[variant].append(launch(variant, steps))
        for anchor in ANCHORS:
            runs[anchor].append(launch_anchor(anchor, steps))
    one_host = _compare(runs, warmup, steps, batch_size)
    one_host["anchors"] = {a: summarize(runs[a], warmup, steps, batch_size) for a in ANCHORS}
    one_host.update(_ratios({**one_host["results"], **one_host["anchors"]}))
    report = {"job": " ".join(THROUGHPUT_JOB), "variants": {v: " ".join(a) for v, a in
                                                            VARIANTS.items()},
              "anchors": {a: f"bench/torchrec_anchors.py {k}" for a, k in ANCHORS.items()},
              "workers": THROUGHPUT_WORKERS, "servers": THROUGHPUT_SERVERS, "steps": steps,
              "timed_after_step": warmup, "repeats": repeats, "one_host": one_host}
    if rates_mbit:
        report["two_hosts"] = two_host_throughput(rates_mbit, repeats, warmup, steps,
                                                  batch_size)
    return report


def two_host_throughput(rates_mbit: tuple[float, ...], repeats: int, warmup: int, steps: int,
                        batch_size: int) -> dict:
    import contextlib
    import tempfile

    sys.path.insert(0, str(HERE.parent))
    from hosts import require_root, two_hosts

    require_root()
    report = {}
    for rate in rates_mbit:
        runs: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
        with contextlib.ExitStack() as stack:
            workdir = pathlib.Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="splitrun-bench-cache-hosts-")))
            hosts = stack.enter_context(two_hosts(rate))
            for _ in range(repeats):
                for variant in VARIANTS:
                    runs[variant].append(launch_two_hosts(hosts, workdir, variant, steps))
        report[f"{rate:g}_mbit"] = _compare(runs, warmup, steps, batch_size)
    return report


def profile(quick: bool, directory: str, variants: list[str]) -> dict:
    """Worker 0's steps and server 0's table store profiled: the cached (LRU
    20 %), uncached and whole-table-cached jobs (or `variants`), steps after
    the warm-up; tables in `directory`/<variant>/{worker0,server0}/."""
    warmup = QUICK_WARMUP_STEPS if quick else WARMUP_STEPS
    steps = warmup + PROFILED_STEPS + 2  # the server's window closes at a later request
    report = {}
    for variant in variants:
        where = str(pathlib.Path(directory) / variant)
        launch(variant, steps, where, warmup)
        report[variant] = where
    return {"profiled_steps": PROFILED_STEPS, "after_step": warmup, "tables": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs")
    parser.add_argument("--repeats", type=int,
                        help="throughput runs per variant (default 3; 1 with --quick)")
    parser.add_argument("--part", choices=["hit_rates", "throughput", "profile"],
                        help="run only this part (profile: only when asked)")
    parser.add_argument("--one-host", action="store_true",
                        help="throughput on this host only (the two-host runs need root)")
    parser.add_argument("--rates-mbit", type=float, nargs="+", default=TWO_HOST_RATES_MBIT,
                        help="link rates of the two-host throughput runs")
    parser.add_argument("--profile-dir", help="--part profile: where the tables go "
                        "(default: bench_profile/ in the working directory)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="--part profile: the jobs to profile (default: all)")
    parser.add_argument("--profile-after", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--final-state", choices=["none", "gather", "views"], default="none",
                        help=argparse.SUPPRESS)
    parser.add_argument("--final-dir", help=argparse.SUPPRESS)
    parser.add_argument("job_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        args.job_args = [a for a in args.job_args if a != "--"]
        run_job(args)
        return
    torch.set_num_threads(1)  # see recsys_cache.DEFAULT_THREADS
    started = time.perf_counter()
    report = {"benchmark": "embedding_cache", "quick": args.quick,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__}}
    if args.part in (None, "hit_rates"):
        report["hit_rates"] = hit_rates(args.quick)
    if args.part in (None, "throughput"):
        rates = () if args.one_host else tuple(args.rates_mbit)
        repeats = args.repeats or (1 if args.quick else 3)
        report["throughput"] = throughput(args.quick, repeats, rates)
    if args.part == "profile":
        report["profile"] = profile(args.quick, args.profile_dir or "bench_profile",
                                     args.variants)
    report["total_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
