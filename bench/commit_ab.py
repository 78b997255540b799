"""One job of bench/embedding_cache.py's throughput part at two commits, runs
interleaved, so a goal such as "within 5 % of today's" is measured against
the old code on the same machine in the same minutes (two runs of one job
minutes apart swing 15-25 % here). Prints JSON.

    python bench/commit_ab.py --base da3f6ed --rounds 3

The base is checked out with `git worktree` in a temporary directory and
imported through a package of links (`splitrun` -> its rooms, as the
editable install maps them here); its own bench/embedding_cache.py runs its
side of the job. Each round runs both, in alternating order; samples/s after
the warm-up, medians, and each round's ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import tempfile

from embedding_cache import (
    MEASURED_STEPS,
    THROUGHPUT_JOB,
    VARIANTS,
    WARMUP_STEPS,
    launch,
    samples_per_s,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The package `splitrun` as the editable install maps it (setup.cfg).
ROOMS = ("launcher", "runtime", "splitter")  # splitrun.<room> -> <room>/
PACKAGE_ROOT = "launcher/root"


def link_package(tree: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """A directory holding `splitrun` for the checkout `tree`."""
    package = into / "splitrun"
    root = tree / PACKAGE_ROOT
    missing = [str(tree / d) for d in [PACKAGE_ROOT, *ROOMS] if not (tree / d).is_dir()]
    if missing:
        raise SystemExit(f"commit_ab: the base's layout is not today's (missing {missing}); "
                         f"pick a base from after the rooms moved")
    shutil.copytree(root, package)
    for room in ROOMS:
        (package / room).symlink_to(tree / room)
    return into


def run_job(tree: pathlib.Path, python_path: pathlib.Path | None, variant: str) -> float:
    """Samples/s after the warm-up of one run of `variant` in checkout `tree`."""
    env = None if python_path is None else {**os.environ, "PYTHONPATH": str(python_path)}
    record = launch(variant, WARMUP_STEPS + MEASURED_STEPS,
                    script=tree / "bench" / "embedding_cache.py", env=env)
    batch_size = int(THROUGHPUT_JOB[THROUGHPUT_JOB.index("--batch-size") + 1])
    return samples_per_s(record["stamps"], WARMUP_STEPS, batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare HEAD's tree with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", default="lru_20_percent", choices=list(VARIANTS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="splitrun-ab-") as scratch:
        base_tree = pathlib.Path(scratch) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(base_tree), args.base], check=True)
        try:
            sides = {"base": (base_tree, link_package(base_tree, pathlib.Path(scratch) / "py")),
                     "head": (ROOT, None)}
            runs: dict[str, list[float]] = {name: [] for name in sides}
            for round_ in range(args.rounds):
                order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
                for name in order:
                    runs[name].append(round(run_job(*sides[name], args.variant), 1))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(base_tree)], check=False)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print(json.dumps({
        "bench": "commit_ab", "job": " ".join([*THROUGHPUT_JOB, *VARIANTS[args.variant]]),
        "base": args.base, "rounds": args.rounds, "samples_per_s": runs,
        "median_samples_per_s": medians,
        "head_vs_base": round(medians["head"] / medians["base"], 3),
        "head_vs_base_per_round": [round(h / b, 3) for h, b in zip(runs["head"], runs["base"])],
    }, indent=1))


if __name__ == "__main__":
    main()
