"""`ray job submit -- python -m splitrun launch --backend ray ...`, for real,
against a local Ray head with its dashboard (Ray's job-submission server) on
127.0.0.2, token authentication off (loopback only, as the tests do).

The submitted entrypoint is the launcher: it runs as the job's driver on the
head node, finds the cluster through the RAY_ADDRESS Ray sets for it (no
--address), and starts the main job's processes (examples/ps_train.py, 2
workers + 1 server) as actors. Prints JSON: the submission's exit code, the
launcher's summary line, the accuracy and the seconds taken.

Needs Ray's dashboard: `pip install -c constraints.txt 'ray[default]==2.60.0'`
(aiohttp, pydantic, opencensus, opentelemetry and their dependencies, about 40
packages; not in the test extra, so no test runs this):

    python bench/ray_job_submit.py [--epochs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

from ray_head import RAY_ENV, RayHead

REPO = pathlib.Path(__file__).resolve().parents[1]
SUBMIT_TIMEOUT_S = 600.0
_SUMMARY = re.compile(r"\[splitrun\] (all \d+ processes finished.*|.*stopped .*)$", re.M)
_ACCURACY = re.compile(r"held-out accuracy: ([0-9.]+)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1, help="of ps_train.py (22 steps each)")
    args = parser.parse_args()
    try:
        import aiohttp  # noqa: F401 - only asks whether the dashboard can run
    except ImportError:
        print("ray job submit needs Ray's dashboard: pip install -c constraints.txt "
              "'ray[default]==2.60.0'", file=sys.stderr)
        return 2
    started = time.monotonic()
    head = RayHead(num_cpus=2, resources={"sr_worker": 2, "sr_server": 1}, dashboard=True)
    try:
        head.wait_up()
        head_start_s = time.monotonic() - started
        entrypoint = [
            sys.executable, "-m", "splitrun", "launch", "--backend", "ray",
            "--workers", "2", "--servers", "1",
            "--worker-resources", '{"CPU": 0.5, "sr_worker": 1}',
            "--server-resources", '{"CPU": 0.5, "sr_server": 1}',
            str(REPO / "examples" / "ps_train.py"), "--epochs", str(args.epochs)]
        env = dict(os.environ)
        env.update(RAY_ENV)
        submitted = time.monotonic()
        result = subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "ray"), "job", "submit",
             "--address", head.dashboard_address, "--", *entrypoint],
            env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=SUBMIT_TIMEOUT_S)
        submit_s = time.monotonic() - submitted
    finally:
        head.close()
    output = result.stdout + result.stderr
    summary = _SUMMARY.search(output)
    accuracy = _ACCURACY.search(output)
    print(json.dumps({
        "benchmark": "ray_job_submit", "entrypoint": shlex.join(entrypoint),
        "exit_code": result.returncode,
        "summary": summary.group(1) if summary else None,
        "accuracy": float(accuracy.group(1)) if accuracy else None,
        "connected_to": (re.search(r"connecting to Ray \(([^)]*)\)", output) or [None, None])[1],
        "head_start_s": round(head_start_s, 2), "submit_to_exit_s": round(submit_s, 2),
    }, indent=2))
    if result.returncode != 0:
        sys.stderr.write(output[-8000:])
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
