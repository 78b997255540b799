"""Run one benchmark and keep its JSON with what produced it, for docs/benchmarks.md.

    python bench/record.py docs/bench-data/transport.json -- python bench/transport.py --quick

Writes one JSON file: the command as given, when it ran, the commit it ran on
(with `+dirty` when the tree had changes), the machine (host, CPUs, load
average before and after) and the benchmark's own JSON, unchanged, under
`result`. The benchmark's stdout must end with one JSON object (every bench in
bench/ prints one last); its stderr goes to this process's stderr as it comes.
`bench/plots.py` draws the pictures from these files. Run benchmarks under the
machine-wide lock (`flock /tmp/splitrun-cpu.lock python bench/record.py ...`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def last_json_object(stdout: str) -> dict:
    """The last top-level JSON object printed: it starts on a line that begins
    with `{` (a pretty-printed object or a one-line one)."""
    lines = stdout.splitlines()
    for start in reversed([i for i, line in enumerate(lines) if line.startswith("{")]):
        try:
            return json.loads("\n".join(lines[start:]))
        except json.JSONDecodeError:
            continue
    raise ValueError("the benchmark printed no JSON object at the end of its output:\n"
                     + stdout[-2000:])


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True,
                              text=True, check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> dict:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_average_before": [round(x, 2) for x in os.getloadavg()]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="the JSON file to write")
    parser.add_argument("--commit", help="the commit the tree holds, where it is a copy "
                        "without git (a device machine's)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- then the benchmark's command line")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the benchmark's command after --")
    machine = _machine()
    started = datetime.datetime.now(datetime.timezone.utc)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        print(f"record: {' '.join(command)} exited with {done.returncode}; nothing written",
              file=sys.stderr)
        sys.stdout.write(done.stdout)
        return done.returncode
    machine["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    record = {"command": " ".join(command), "started": started.isoformat(timespec="seconds"),
              "wall_s": round((datetime.datetime.now(datetime.timezone.utc)
                               - started).total_seconds(), 1),
              "commit": args.commit or _commit(), "machine": machine,
              "result": last_json_object(done.stdout)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
