"""Draw docs/benchmarks.md's plots from the benchmark runs kept in docs/bench-data/.

    python bench/plots.py [--data docs/bench-data] [--out docs/img]

Each file in --data is what `bench/record.py` wrote: the command, commit, date and
machine of one run and the benchmark's own JSON under `result`. One PNG per file,
`bench-<file name>.png`, drawn by the function registered for its benchmark; every
plot's footnote gives the command, the commit and the machine's load, so a picture
never stands apart from the run it shows. A file no function knows is an error
naming it: add its drawing here.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
MiB = 1 << 20
SPLITRUN = "#2c7fb8"
BASELINE = "#bdbdbd"
OTHER = "#7fcdbb"


def _bars(ax, labels: list[str], values: list[float], colours: list[str], unit: str,
          fmt: str = "{:.3g}") -> None:
    bars = ax.barh(labels, values, color=colours)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    for bar, value in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + fmt.format(value),
                va="center", fontsize=8)
    ax.margins(x=0.18)


def _colour(name: str) -> str:
    return SPLITRUN if name.startswith("splitrun") else BASELINE


def splitter_scale(result: dict, fig) -> None:
    rows = sorted(result["results"], key=lambda r: r["nodes"])
    ax = fig.add_subplot()
    nodes = [r["nodes"] for r in rows]
    ax.plot(nodes, [r["median_s"] for r in rows], "o-", color=SPLITRUN, label="split (median)")
    ax.plot(nodes, [rows[0]["median_s"] * n / nodes[0] for n in nodes], ":", color=BASELINE,
            label="linear in the nodes")
    if "goal_100k_under_s" in result:
        ax.axhline(result["goal_100k_under_s"], color="#e34a33", lw=0.8,
                   label=f"goal at 100 k: {result['goal_100k_under_s']:g} s")
    for r in rows:
        ax.annotate(f"{r['median_s']:.2f} s", (r["nodes"], r["median_s"]), fontsize=8,
                    textcoords="offset points", xytext=(4, -10))
    ax.set_xlabel("nodes in the graph (8 labels)")
    ax.set_ylabel("seconds to split")
    ax.legend(fontsize=8)
    ax.set_title("GraphSplitter.split() time")


TRANSPORT_NAMES = {"splitrun_shm": "splitrun, shared memory", "splitrun": "splitrun, gRPC",
                   "gloo": "gloo (torch.distributed)", "tcp": "raw TCP",
                   "grpc_unary": "bare grpcio unary call"}


def transport(result: dict, fig) -> None:
    table = result["results"]
    kinds = [k for k in TRANSPORT_NAMES if k in table]
    big, small = str(64 * MiB), str(4 << 10)
    left, right = fig.subplots(1, 2)
    with_big = [k for k in kinds if big in table[k]]
    _bars(left, [TRANSPORT_NAMES[k] for k in with_big], [table[k][big]["gbps"] for k in with_big],
          [_colour(k) for k in with_big], "GB/s")
    left.set_title("64 MiB, one way (higher is better)", fontsize=9)
    with_small = [k for k in kinds if small in table[k]]
    _bars(right, [TRANSPORT_NAMES[k] for k in with_small],
          [table[k][small]["rtt_us"] for k in with_small], [_colour(k) for k in with_small],
          "µs", "{:.0f}")
    right.set_title("4 KiB round trip (lower is better)", fontsize=9)
    right.set_yticklabels([])
    fig.suptitle("Between two processes of one host")


HOSTS_NAMES = {"splitrun_tcp": "splitrun, TCP data plane",
               "splitrun_tcp1": "splitrun, TCP, one connection", "splitrun": "splitrun, gRPC",
               "gloo": "gloo", "tcp": "raw TCP", "grpc_stream": "bare grpcio stream"}
HOSTS_COLOURS = {"splitrun_tcp": SPLITRUN, "splitrun_tcp1": "#9ecae1", "splitrun": OTHER,
                 "gloo": "#636363", "tcp": BASELINE, "grpc_stream": "#f7f7f7"}


def transport_hosts(result: dict, fig) -> None:
    """64 MiB one way over each path, on loopback and between two network
    namespaces (unshaped and at 10 Gbit/s)."""
    ax = fig.subplots(1, 1)
    settings = list(result["paths"])
    kinds = [k for k in HOSTS_NAMES if all(k in result["paths"][s] for s in settings)]
    width = 0.8 / len(kinds)
    big = str(64 * MiB)
    for i, kind in enumerate(kinds):
        values = [result["paths"][s][kind][big]["gbps"] for s in settings]
        xs = [x + (i - (len(kinds) - 1) / 2) * width for x in range(len(settings))]
        ax.bar(xs, values, width, label=HOSTS_NAMES[kind], color=HOSTS_COLOURS[kind],
               edgecolor="#636363", linewidth=0.5)
    ax.set_xticks(range(len(settings)), settings)
    ax.set_ylabel("GB/s, 64 MiB one way (higher is better)")
    ax.legend(fontsize=8)
    ax.set_title("Between hosts: the TCP data plane next to gloo and raw TCP")


def shm_ring(result: dict, fig) -> None:
    table = result["results"]
    sizes = sorted(int(s) for s in table["tcp"])
    ax = fig.add_subplot()
    width = 0.38
    for offset, (kind, label, colour) in enumerate(
            (("shm_ring", "shared-memory ring", SPLITRUN), ("tcp", "raw TCP", BASELINE))):
        values = [table[kind][str(s)]["throughput_gbytes_s"] for s in sizes]
        xs = [i + (offset - 0.5) * width for i in range(len(sizes))]
        ax.bar(xs, values, width, color=colour, label=label)
        for x, value in zip(xs, values):
            ax.text(x, value, f"{value:.2g}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(sizes)), [_size(s) for s in sizes])
    ax.set_xlabel("message (one way, then a 1-byte ack)")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=8)
    ax.set_title("The ring alone against a TCP socket pair")


def _size(size: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


PS_NAMES = {"single_process": "one process", "torch_rpc_tutorial_ps": "RPC tutorial server",
            "torch_rpc_batch_update_ps": "RPC batch-update server",
            "splitrun_ps": "splitrun, gRPC", "splitrun_shm_ps": "splitrun, shared memory",
            "splitrun_shm_ps_op_by_op": "splitrun, shared memory, update op by op"}


def ps_throughput(result: dict, fig) -> None:
    runs = result["results"]
    names = [n for n in PS_NAMES if n in runs]
    ax = fig.add_subplot()
    _bars(ax, [PS_NAMES[n] for n in names], [runs[n]["steps_per_s"] for n in names],
          [_colour(n) for n in names], "steps/s (median)")
    ax.set_title(f"Parameter server: 2 workers + 1 server, {result['parameters'] / 1e6:.1f} M "
                 f"parameters, global batch {result['global_batch']}\nsplitrun over shared "
                 f"memory {result['splitrun_shm_over_rpc']:.2f}× the tutorial", fontsize=9)


PARALLEL_NAMES = {"mlp": "MLP", "vocab": "vocabulary-parallel", "norm": "layer-norm block",
                  "dp": "data-parallel"}


PS_NAMES = {"single_process": "one process, 2 threads", "ddp_2_processes": "DDP, 2 processes",
            "splitrun_shm_ps": "splitrun, synchronous"}


def _ps_name(key: str) -> str:
    return PS_NAMES.get(key, key.replace("splitrun_shm_ps_stale", "splitrun, staleness="))


def ps_staleness(result: dict, fig) -> None:
    """What a bench/ps_throughput.py run with --stale measured: steps/s of
    each configuration (--part throughput), and the seconds each took to
    each task's target (--part tta; "not reached": it did not get there)."""
    tasks = result.get("time_to_target", {})
    panels = iter(fig.subplots(1, ("results" in result) + len(tasks), squeeze=False)[0])
    if "results" in result:
        runs = result["results"]
        ax = next(panels)
        _bars(ax, [_ps_name(k) for k in runs], [runs[k]["steps_per_s"] for k in runs],
              [_colour(k) for k in runs], "steps/s")
        ax.set_title("6.7 M-parameter MLP (higher is better)", fontsize=9)
    for name, task in tasks.items():
        reached = task["results"]
        labels = [_ps_name(k) + (f", {reached[k]['steps']:g} steps"
                                 if reached[k]["seconds"] is not None else
                                 f" (reached {reached[k]['runs_reached']})") for k in reached]
        ax = next(panels)
        _bars(ax, labels, [reached[k]["seconds"] or 0 for k in reached],
              [_colour(k) for k in reached], "seconds (median)", "{:.2f}")
        ax.set_title(f"{name}: time to {task['target'].replace('held-out ', '')}",
                     fontsize=9)
    fig.suptitle("Parameter servers with bounded staleness")


PHASE_COLOURS = {"ops_and_rest": "#9ecae1", "tiled_update": "#fdae6b", "sends": "#e6550d",
                 "other_threads": "#a63603", "receives": "#636363"}


def ps_phases(result: dict, fig) -> None:
    """A bench/ps_throughput.py run's CPU a step (bench/ps_phases.py) of each
    parameter-server configuration and process, stacked by phase."""
    runs = {k: v for k, v in result["results"].items() if "phases_ms_per_step" in v}
    ax = fig.add_subplot()
    labels, rows = [], []
    for config, entry in runs.items():
        for process, phases in entry["phases_ms_per_step"].items():
            labels.append(f"{_ps_name(config)}: {process}")
            rows.append(phases)
    left = [0.0] * len(rows)
    for phase, colour in PHASE_COLOURS.items():
        widths = [row.get(phase, 0.0) for row in rows]
        ax.barh(labels, widths, left=left, color=colour, label=phase.replace("_", " "))
        left = [a + b for a, b in zip(left, widths)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.1f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms of CPU a step (median of the runs)")
    ax.margins(x=0.12)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    totals = ", ".join(f"{_ps_name(k).removeprefix('splitrun, ')} {v['cpu_ms_per_step_total']:g}"
                       for k, v in runs.items())
    ax.set_title(f"all processes, ms a step: {totals}", fontsize=8)
    fig.suptitle("Where a parameter-server step's CPU goes")


PIPELINE_NAMES = {
    "splitrun_no_microbatches": "splitrun, no micro-batches",
    "splitrun_no_microbatches_2_threads": "splitrun, no micro-batches, 2 threads each",
    "splitrun_gpipe": "splitrun GPipe", "splitrun_1f1b": "splitrun 1F1B",
    "splitrun_interleaved": "splitrun interleaved 1F1B",
    "torch_gpipe": "torch ScheduleGPipe", "torch_1f1b": "torch Schedule1F1B",
    "torch_interleaved": "torch ScheduleInterleaved1F1B",
    "unsplit_one_process": "unsplit, 1 process, 2 threads",
    "unsplit_one_process_1_thread": "unsplit, 1 process, 1 thread",
}


def pipeline(result: dict, fig) -> None:
    """Steps/s of each configuration, and each schedule's measured bubble
    (the processes' mean) against the theory."""
    left, right = fig.subplots(1, 2)
    runs = result["results"]
    _bars(left, [PIPELINE_NAMES.get(k, k) for k in runs], [runs[k]["steps_per_s"] for k in runs],
          [OTHER if k.startswith("unsplit") else _colour(k) for k in runs], "steps/s")
    left.set_title(f"{result['model']}\n{result['processes']} processes, "
                   f"{result['microbatches']} micro-batches (higher is better)", fontsize=8)
    theory = result["theory_bubble_by_schedule"]
    names, values, colours = [], [], []
    for schedule in theory:
        for system in ("splitrun", "torch"):
            row = runs.get(f"{system}_{schedule}")
            if row is not None and "bubble" in row:
                names.append(PIPELINE_NAMES[f"{system}_{schedule}"])
                values.append(sum(row["bubble"]) / len(row["bubble"]))
                colours.append(_colour(system))
        names.append(f"theory, {schedule}")
        values.append(theory[schedule])
        colours.append(OTHER)
    _bars(right, names, values, colours, "idle fraction", "{:.3f}")
    right.set_title("bubble (lower is better)", fontsize=9)
    fig.suptitle("Pipelines: micro-batched schedules next to torch.distributed.pipelining")


def pipeline_ceiling(result: dict, fig) -> None:
    """The thread rows: what the unmicro-batched split and the unsplit step
    do with 1 and 2 threads a process, next to 1F1B and its ceiling."""
    ax = fig.add_subplot()
    runs = result["results"]
    names = [PIPELINE_NAMES.get(k, k) for k in runs]
    values = [runs[k]["steps_per_s"] for k in runs]
    colours = [OTHER if k.startswith("unsplit") else _colour(k) for k in runs]
    best = result["ceiling"].get("1f1b")
    if best is not None:
        names.append("1F1B's ceiling from its measured work")
        values.append(1000 / best["best_step_ms"])
        colours.append(BASELINE)
    _bars(ax, names, values, colours, "steps/s")
    ax.set_title("1 thread per stage against 2 (the machine has 2 cores)", fontsize=9)


def parallel(result: dict, fig) -> None:
    entries = [e for e in result["results"] if "dtensor" in e]
    labels = [f"{PARALLEL_NAMES.get(e['model'], e['model'])}\n{e['ranks']} ranks" for e in entries]
    ours = [e["splitrun"]["global"]["bytes_per_rank"] for e in entries]
    theirs = [e["dtensor"]["bytes_per_rank_ring"] for e in entries]
    ax = fig.add_subplot()
    width = 0.38
    for offset, (values, label, colour) in enumerate(
            ((ours, "splitrun (global)", SPLITRUN), (theirs, "DTensor", BASELINE))):
        xs = [i + (offset - 0.5) * width for i in range(len(entries))]
        ax.bar(xs, values, width, color=colour, label=label)
    ax.set_xticks(range(len(entries)), labels, fontsize=8)
    ax.set_ylabel("bytes each rank sends per step")
    ax.legend(fontsize=8)
    ax.set_title("Parallel mode: collective bytes per step (lower is better)")


def embedding_cache_hit_rates(result: dict, fig) -> None:
    rows = result["hit_rates"]["results"]
    goal = result["hit_rates"]["goals"]["at"]
    chosen = [r for r in rows if r["zipf"] == goal["zipf"]]
    chosen.sort(key=lambda r: r["cache_fraction"])
    ax = fig.add_subplot()
    width = 0.26
    series = (("lru", "LRU", SPLITRUN), ("lfu", "LFU", OTHER), ("ideal_static", "ideal static",
                                                                   BASELINE))
    for offset, (key, label, colour) in enumerate(series):
        xs = [i + (offset - 1) * width for i in range(len(chosen))]
        values = [r["per_lookup"][key] for r in chosen]
        ax.bar(xs, values, width, color=colour, label=label)
        for x, value in zip(xs, values):
            ax.text(x, value, f"{value:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(chosen)), [f"{r['cache_fraction']:.0%} cached" for r in chosen])
    ax.set_ylabel("hit rate per lookup")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"Row-cache hit rates, Zipf {goal['zipf']:g} over "
                 f"{result['hit_rates']['table_rows']:,} rows")


CACHE_NAMES = {"lru_20_percent": "splitrun, LRU 20 %", "none": "splitrun, uncached",
               "whole_table_cached": "splitrun, whole tables cached"}
ANCHOR_NAMES = {"torch_one_process": "plain torch, one process",
                "torchrec_fused_one_process": "TorchRec fused collection, one process",
                "torchrec_dmp_2_processes": "TorchRec DMP, 2 processes"}


def embedding_cache_throughput(result: dict, fig) -> None:
    one_host = result["throughput"]["one_host"]
    jobs = {**one_host["results"], **one_host["anchors"]}
    names = [*[n for n in CACHE_NAMES if n in one_host["results"]], *one_host["anchors"]]
    labels = [CACHE_NAMES.get(n) or ANCHOR_NAMES.get(n, n) for n in names]
    ax = fig.add_subplot()
    _bars(ax, labels, [jobs[n]["samples_per_s"] for n in names],
          [SPLITRUN if n in CACHE_NAMES else BASELINE for n in names], "samples/s (median)",
          "{:,.0f}")
    ax.set_title("DLRM with 8 tables, one host: splitrun (1 worker + 2 servers)\nand what "
                 "users would run instead", fontsize=9)


def startup(result: dict, fig) -> None:
    median = result["median"]
    backends = list(median)
    ax = fig.add_subplot()
    width = 0.38
    for offset, (key, label, colour) in enumerate(
            (("ready_s", "ready to step", SPLITRUN), ("end_to_end_s", "end to end", OTHER))):
        xs = [i + (offset - 0.5) * width for i in range(len(backends))]
        values = [median[b][key] or 0 for b in backends]
        ax.bar(xs, values, width, color=colour, label=label)
        for x, value in zip(xs, values):
            ax.text(x, value, f"{value:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(backends)), backends)
    ax.set_ylabel("seconds from starting the launcher")
    ax.legend(fontsize=8)
    ax.set_title("The main job's start-up by backend (local_exec: fresh interpreters)")


GPU_TRANSPORT_NAMES = {"shm_transport": "splitrun, the job's path", "ring_cuda": "the ring alone",
                       "shm_transport_unpinned": "splitrun, unpinned receives",
                       "memcpy_pinned": "cudaMemcpy via pinned host",
                       "memcpy_pageable": "cudaMemcpy via pageable host"}


def gpu(result: dict, fig) -> None:
    left, right = fig.subplots(1, 2)
    transport = result.get("transport_64MiB", {})
    kinds = [k for k in GPU_TRANSPORT_NAMES if k in transport]
    _bars(left, [GPU_TRANSPORT_NAMES[k] for k in kinds], [transport[k]["gbytes_s"] for k in kinds],
          [BASELINE if k.startswith("memcpy") else SPLITRUN for k in kinds], "GB/s")
    left.set_title("64 MiB device → another process's device", fontsize=9)
    jobs = []
    if "main_job" in result:
        cuda = result["main_job"]["cuda"]
        jobs.append(("main job", cuda["splitrun_vs_one_process"]))
    if "ps_bench_model_cuda" in result:
        jobs.append(("PS model, 6.7 M",
                     result["ps_bench_model_cuda"]["splitrun_vs_one_process"]))
    _bars(right, [name for name, _ in jobs], [ratio for _, ratio in jobs],
          [SPLITRUN] * len(jobs), "× one process on the GPU", "{:.2f}×")
    right.axvline(1.0, color=BASELINE, lw=0.8)
    right.set_title("2 workers + 1 server\non the one GPU", fontsize=9)
    fig.suptitle(f"{result['device']}, torch {result['torch']}")


DRAWINGS: dict[str, Callable[[dict, object], None]] = {
    "splitter_scale": splitter_scale, "transport": transport, "shm_ring": shm_ring,
    "ps_throughput": ps_throughput, "parallel": parallel,
    "embedding_cache_hit_rates": embedding_cache_hit_rates,
    "embedding_cache_throughput": embedding_cache_throughput,
    "embedding_cache_throughput_again": embedding_cache_throughput,
    "embedding_cache_throughput_16_cores": embedding_cache_throughput, "startup": startup,
    "gpu": gpu, "transport_hosts": transport_hosts,
    "ps_staleness": ps_staleness, "ps_staleness_s2": ps_staleness,
    "ps_staleness_tta": ps_staleness, "ps_staleness_tta_quiet": ps_staleness,
    "pipeline": pipeline, "pipeline_ceiling": pipeline_ceiling,
    "ps_staleness_copies": ps_phases, "ps_staleness_copies_tta": ps_staleness,
    "ps_copies_cached": ps_phases, "ps_copies_streamed": ps_phases, "ps_copies_quiet": ps_phases,
}


def footnote(record: dict) -> str:
    machine = record["machine"]
    load = machine.get("load_average_before", ["?"])[0]
    return (f"{record['command']}\n{record['started'][:10]}, commit {record['commit']}, "
            f"{machine['cpus']} CPUs, load {load} at the start")


def draw(path: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    record = json.loads(path.read_text())
    drawing = DRAWINGS.get(path.stem)
    if drawing is None:
        raise SystemExit(f"{path}: no drawing for '{path.stem}' in bench/plots.py; add one "
                         f"to DRAWINGS (known: {', '.join(sorted(DRAWINGS))})")
    fig = plt.figure(figsize=(8, 4.2))
    drawing(record["result"], fig)
    fig.text(0.01, 0.01, footnote(record), fontsize=6.5, color="#636363", va="bottom")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    target = out / f"bench-{path.stem}.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=pathlib.Path, default=REPO / "docs" / "bench-data")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "docs" / "img")
    args = parser.parse_args()
    files = sorted(args.data.glob("*.json"))
    if not files:
        raise SystemExit(f"{args.data}: no benchmark runs (bench/record.py keeps them)")
    args.out.mkdir(parents=True, exist_ok=True)
    for path in files:
        print(draw(path, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
