"""How a process started, and one way of ending per start of the job, for the
tests of the launcher's start methods (tests/e2e/test_start_methods_e2e.py):

    splitrun launch --workers 1 --max-restarts 6 tests/support/scripts/endings.py --dir DIR

Each start (one process) writes what it sees of itself to DIR/facts-K.json (K:
the starts before it, counted by those files), then ends as ENDINGS[K] says.
With --ending E, every process of the job ends as E says, after writing
DIR/facts-<role><rank>.json; `wait` starts a process of its own (in its
group, as a data loader's worker is), says so, and waits to be stopped.
The last ending is a clean one: the script returns while a non-daemon thread
still has to write DIR/thread-done, an exit handler writes DIR/atexit-done,
and the last line printed has no newline.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading

import numpy

from splitrun.splitter.errors import LabelError

ENDINGS = ("exit-code", "exception", "splitrun-error", "sigkill", "keyboard-interrupt",
           "exit-message", "clean")
# Bounds the `wait` ending: the tests stop it long before.
WAIT_S = 300


def facts() -> dict:
    return {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0),
            "sid": os.getsid(0), "stdin": sys.stdin.read(), "cwd": os.getcwd(),
            "argv": sys.argv, "name": __name__, "path0": sys.path[0],
            "role": os.environ.get("SPLITRUN_ROLE"),
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
            "numpy": int(numpy.random.randint(2**31)),
            "random": random.getrandbits(32),
            "cmdline": pathlib.Path("/proc/self/cmdline").read_text().split("\0")[:-1]}


def end_cleanly(directory: pathlib.Path) -> None:
    def after_main() -> None:
        threading.main_thread().join()  # returns once the interpreter shuts down
        (directory / "thread-done").write_text("done")
    threading.Thread(target=after_main).start()
    atexit.register(lambda: (directory / "atexit-done").write_text("done"))
    print("last words", end="")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=pathlib.Path, required=True)
    parser.add_argument("--ending", choices=(*ENDINGS, "wait"), default=None)
    args = parser.parse_args()
    if args.ending is None:
        start = len(list(args.dir.glob("facts-*.json")))
        name, ending = f"facts-{start}.json", ENDINGS[start]
    else:
        process = os.environ["SPLITRUN_ROLE"] + os.environ["SPLITRUN_RANK"]
        name, ending = f"facts-{process}.json", args.ending
    (args.dir / name).write_text(json.dumps(facts()))
    if ending == "exit-code":
        sys.exit(3)
    if ending == "exception":
        raise ValueError("boom")
    if ending == "splitrun-error":
        raise LabelError("label w9 is out of range: only 1 worker")
    if ending == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if ending == "keyboard-interrupt":
        raise KeyboardInterrupt
    if ending == "exit-message":
        sys.exit("bye")
    if ending == "wait":
        helper = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({WAIT_S})"])
        print(f"waiting, with a helper (pid {helper.pid})", flush=True)
        helper.wait(WAIT_S)
        sys.exit(4)
    end_cleanly(args.dir)


if __name__ == "__main__":
    main()
