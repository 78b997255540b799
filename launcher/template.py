"""The template process: the processes of a local job are forked from it.

    python -m splitrun.launcher.template --parent-pid PID --socket FD --script PATH

Importing torch and splitrun's job machinery (capture, the job runtime) is
most of a process's start-up: seconds of CPU in every process, all at once.
The template imports them once (`PRELOAD`, --preload, and the installed
modules the script imports first: script_imports.py), then forks one process
for each request of the launcher (`forked.Template`); the forked process runs the
script through the bootstrap, as `python -m splitrun.launcher.bootstrap ...`
would in a fresh interpreter. Like the bootstrap, this module imports only the
standard library before its `main()` runs.

Why the fork is safe: the template only imports. It starts no gRPC channel or
server (gRPC initialises its core, and starts threads, only then), does not
initialise CUDA, and runs no torch operation (torch's intra-op and inter-op
thread pools start at the first parallel operation). It checks this before
every fork: one thread, CUDA not initialised; otherwise it answers `exec` and
the launcher starts that process from a fresh interpreter. numpy's OpenBLAS
starts a thread pool when loaded and stops it before any fork (its
pthread_atfork handler); a probe fork right after the imports stops it for good,
so the check then sees one thread.

Each process is forked twice (the first child exits at once), so that the
launcher, a child subreaper, adopts it: the launcher waits for it, reads its
exit status and signals its process group as for a process it started itself.
Before the script runs, the forked process leads a session of its own (its
process group id is its pid), its stdout and stderr are the pipe the launcher
sent, its stdin is /dev/null, its environment and working directory are the
request's, and numpy's global random state is reseeded (Python's `random`
reseeds itself after a fork). Then the bootstrap sets PR_SET_PDEATHSIG once the
launcher is its parent, as in a process the launcher started with exec. It
ends as multiprocessing's forked processes do (`run_forked`): with the status
the interpreter would give, without the interpreter's teardown.

A forked process differs from a fresh one in what was decided at import time,
in the template, from the template's environment; the launcher forks only a
process whose environment differs from the template's in splitrun's own
variables (SPLITRUN_*, read by `Job.from_env()`, not at import). A script that
sets a variable before importing torch (OMP_NUM_THREADS, ...) sets it too late;
`splitrun launch --start-method exec` starts every process fresh. The forked
processes share the template's str hash seed.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator

__all__ = ["BOOTSTRAP_MODULE", "PRELOAD", "MAX_MESSAGE_BYTES", "collected_once", "fork_problem",
           "main", "preload_modules", "preload_script_imports", "probe_fork", "run_forked",
           "set_up_process"]

# The command a forked process stands in for: [sys.executable, "-m", BOOTSTRAP_MODULE, ...].
BOOTSTRAP_MODULE = "splitrun.launcher.bootstrap"
# What every process of a job imports before its first step, as "module" or
# "module:public name" (a lazily exported name, resolved): torch, the capture
# (torch._dynamo, aot_autograd) and the job runtime (gRPC imported, not started).
PRELOAD = ("torch", "splitrun.splitter:capture", "splitrun.runtime:Job")
# A request or an answer is one message of the control socket (SOCK_SEQPACKET).
MAX_MESSAGE_BYTES = 1 << 20
# Bounds a forked process's wait for the launcher to adopt it: its first
# parent's exit, which comes right after the fork.
ADOPTION_TIMEOUT_S = 30.0


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from .bootstrap import die_with_parent  # the standard library only

    die_with_parent(args.parent_pid)
    control = socket.socket(fileno=args.socket)
    # The path the script's process will have (as the bootstrap sets it), for
    # --preload of the script's own modules.
    sys.path[0] = os.path.dirname(args.script)
    preload = (*PRELOAD, *args.preload)
    started = time.monotonic()
    with collected_once():
        problem = preload_modules(preload)
        if problem is None:
            preload += tuple(preload_script_imports(args.script))
        problem = problem or probe_fork() or fork_problem()
        if problem is not None:
            _send(control, {"unusable": problem})
            _exit_now()
    _send(control, {"ready": {"preloaded": list(preload),
                              "took_s": round(time.monotonic() - started, 2)}})
    bootstrap_args = _serve(control)
    if bootstrap_args is None:
        _exit_now()  # the launcher closed the socket: its job is done
    run_forked(bootstrap_args)


@contextlib.contextmanager
def collected_once() -> Iterator[None]:
    """Run the imports inside without the garbage collector, then collect
    once, freeze what is left and turn the collector back on.

    The imports make half a million objects; the collector's full passes over
    them while they are made (one every few tens of thousands) cost a fifth
    of the imports' CPU and find next to nothing: one pass after them does
    that work once. Frozen: the forked processes share the template's memory
    until they write to it, and the collector's passes over the preloaded
    objects would write to all of them (and find them alive: imports keep
    them). Back on: a forked process collects as a fresh one does."""
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()


def run_forked(bootstrap_args: list[str]) -> None:
    """In a forked process: run the script as the bootstrap's own process
    does, and exit with the status the interpreter would give, as
    multiprocessing's forked processes do: non-daemon threads joined, exit
    handlers run, streams flushed, then `os._exit` without the interpreter's
    teardown (its frees would write to, and so copy, every page shared with
    the template: seconds of a loaded machine)."""
    from .bootstrap import main as bootstrap_main

    code = 0
    try:
        bootstrap_main(bootstrap_args)
    except SystemExit as exc:
        code = _system_exit_code(exc)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT  # the interpreter ends by SIGINT then
    except BaseException:  # noqa: BLE001 - reported as the interpreter does
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # noqa: SLF001 - as multiprocessing's children do
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _system_exit_code(exc: SystemExit) -> int:
    """The exit status the interpreter gives for an uncaught `exc`."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    sys.stderr.write(f"{exc.code}\n")
    return 1


def _exit_now() -> None:
    """Exit without tearing torch down (seconds, while the launcher waits)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fork_problem() -> str | None:
    """Why this process must not be forked from now, or None."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        return f"the template cannot fork: it runs {threads} threads (a preloaded module " \
               f"started them)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the template cannot fork: it initialised CUDA"
    return None


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m splitrun.launcher.template")
    parser.add_argument("--parent-pid", type=int, required=True, help="the launcher's pid")
    parser.add_argument("--socket", type=int, required=True,
                        help="the file descriptor of the launcher's control socket")
    parser.add_argument("--script", required=True,
                        help="the absolute path of the script the processes run")
    parser.add_argument("--preload", action="append", default=[],
                        help="also import this module")
    return parser.parse_args(argv)


@contextlib.contextmanager
def logging_left_unconfigured() -> Iterator[None]:
    """Take off again the root logger's handlers that imports inside add.

    A library that logs while it loads (fbgemm_gpu: "Successfully loaded")
    makes `logging` give the root logger a default handler. In a fresh process
    the bootstrap has configured logging before the script imports it, and
    that call adds nothing; in a process forked from a template that imported
    it, the bootstrap would find a handler, leave logging as it is
    (configure_logging) and the process's log lines and the driver's progress
    lines would be lost."""
    import logging

    before = list(logging.root.handlers)
    try:
        yield
    finally:
        for handler in [h for h in logging.root.handlers if h not in before]:
            logging.root.removeHandler(handler)


def preload_modules(preload: tuple[str, ...]) -> str | None:
    with logging_left_unconfigured():
        for spec in preload:
            module, _, name = spec.partition(":")
            try:
                loaded = importlib.import_module(module)
                if name:
                    getattr(loaded, name)
            except Exception as exc:  # noqa: BLE001 - any failure: the launcher execs instead
                traceback.print_exc()
                return f"the template could not import {spec}: {type(exc).__name__}: {exc}"
    return None


def preload_script_imports(script: str) -> list[str]:
    """Import the installed modules the script imports first (script_imports.py);
    the ones this imported. A module that fails to import is left to the
    script's own processes, which report it as usual."""
    from .script_imports import installed, leading_imports  # the standard library only

    try:
        with open(script, encoding="utf-8") as file:
            modules = leading_imports(file.read())
    except (OSError, UnicodeDecodeError):
        return []
    imported = []
    with logging_left_unconfigured():
        for module in modules:
            if module in sys.modules or not installed(module):
                continue
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001, S112 - not a module, or broken: the script's to report
                continue
            imported.append(module)
    return imported


def probe_fork() -> None:
    """Fork a child that exits at once: libraries that stop their threads
    before a fork (numpy's OpenBLAS) leave this process with one."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _send(control: socket.socket, message: dict) -> None:
    control.sendall(json.dumps(message).encode())


def _serve(control: socket.socket) -> list[str] | None:
    """Fork a process for each request until the launcher closes the socket
    (None). Returns in a forked process only: its bootstrap's arguments."""
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE_BYTES, 1)
        except OSError:
            return None
        if not message:
            return None
        request = json.loads(message)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            _send(control, {"exec": "the request came without an output pipe"})
            continue
        out_fd = fds[0]
        problem = fork_problem()
        if problem is not None:
            os.close(out_fd)
            _send(control, {"exec": problem})
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        forked = _fork(request, out_fd, control)
        if isinstance(forked, list):
            return forked  # in the forked process
        os.close(out_fd)
        _send(control, {"pid": forked} if isinstance(forked, int) else {"exec": forked})


def _fork(request: dict, out_fd: int, control: socket.socket) -> int | str | list[str]:
    """Fork the requested process through a first child that exits at once.
    In the template: the process's pid (or why it failed); in the process: its
    bootstrap's arguments."""
    report_read, report_write = os.pipe()
    first = os.fork()
    if first == 0:  # the first child: fork the process, tell its pid, exit
        try:
            os.close(report_read)
            first_gone = os.pidfd_open(os.getpid())
            pid = os.fork()
            if pid != 0:
                os.write(report_write, str(pid).encode())
                os._exit(0)
            os.close(report_write)
        except BaseException:  # noqa: BLE001 - never return into the template's loop
            os._exit(1)
        return _become_process(request, out_fd, control, first_gone)
    os.close(report_write)
    with os.fdopen(report_read, "rb") as report:
        pid = report.read()
    os.waitpid(first, 0)  # once it is reaped, the launcher has adopted the process
    return int(pid) if pid else "the template's fork failed"


def _become_process(request: dict, out_fd: int, control: socket.socket,
                    first_gone: int) -> list[str]:
    """Set the forked process up as the launcher would have started it."""
    try:
        control.close()
        # Adopted by the launcher (the subreaper) once its first parent has
        # exited, which makes that parent's pidfd readable.
        ready, _, _ = select.select([first_gone], [], [], ADOPTION_TIMEOUT_S)
        os.close(first_gone)
        if not ready:
            raise RuntimeError(f"its first parent did not exit within {ADOPTION_TIMEOUT_S} s")
        set_up_process(request, out_fd)
        return list(request["argv"][3:])
    except BaseException:  # noqa: BLE001 - never return into the template's loop
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def set_up_process(request: dict, out_fd: int) -> None:
    """In a forked process: lead a session of its own, stdin /dev/null, stdout
    and stderr `out_fd`, and the working directory, environment and numpy
    random state a fresh process of `request` would have."""
    os.setsid()
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # a fresh process seeds it from the OS too


if __name__ == "__main__":
    main()
