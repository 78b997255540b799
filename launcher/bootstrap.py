"""What every process the launcher starts runs first:

    python -m splitrun.launcher.bootstrap [--parent-pid PID] SCRIPT [ARGS...]

It sets the process up before the user's script runs (and before anything
imports torch): on Linux the kernel kills it when the launcher (PID) dies;
logging goes to stderr at the launcher's level; then SCRIPT runs as
`__main__`, as `python SCRIPT ARGS...` would run it. Under `splitrun plan` the
script ends at `Job.start()` with `PlanWritten`, which exits 0 here. A script
ending with a splitrun error (a `SplitrunError`) writes one line (ERROR_MARK,
the error's type and message) instead of a traceback, after telling the
scheduler, and exits at once (its exit handlers run, the interpreter's slow
teardown does not); other exceptions keep their traceback.

Only the standard library is imported before the script runs, so the
die-with-launcher setting is in place within milliseconds of the start.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import runpy
import signal
import sys

__all__ = ["main", "ERROR_MARK"]

_PR_SET_PDEATHSIG = 1
# Starts the one line a process writes for a splitrun error; the launcher shows
# it in its failure line instead of relaying it from every process.
ERROR_MARK = "splitrun error: "
# The same variable `splitrun.runtime.cluster.env.ENV.LOG_LEVEL` names; not imported
# from there, because importing splitrun.runtime imports torch.
_LOG_LEVEL_VARIABLE = "SPLITRUN_LOG_LEVEL"


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux);
    exit at once if the parent is already gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass  # the heartbeat timeout stops an orphan instead
    if os.getppid() != parent_pid:
        sys.stderr.write(f"splitrun: the launcher (pid {parent_pid}) is gone; not starting\n")
        raise SystemExit(1)


# torch's advice to the authors of code that calls torch.fx's is_fx_tracing()
# (TorchRec's KeyedJaggedTensor does, through its ProxyableClassMeta), logged
# by every process that builds one: nothing the user of a job can act on. Only
# that line of that logger is dropped.
_TORCH_FX_LOGGER = "torch.fx._symbolic_trace"
_IS_FX_TRACING_ADVICE = "is_fx_tracing will return true"


class _DropIsFxTracingAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_IS_FX_TRACING_ADVICE)


# The driver's progress lines: shown at every level (they are the progress
# bar of a job whose output is a pipe), plainly.
_PROGRESS_LOGGER = "splitrun.runtime.job.progress"


def configure_logging(level: str | None) -> None:
    if level and not logging.getLogger().handlers:
        logging.basicConfig(level=level.upper(), stream=sys.stderr,
                            format="%(levelname)s %(name)s: %(message)s")
        progress = logging.getLogger(_PROGRESS_LOGGER)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        progress.addHandler(handler)
        progress.setLevel(min(logging.INFO, logging.getLogger().level))
        progress.propagate = False


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "--parent-pid":
        die_with_parent(int(argv[1]))
        argv = argv[2:]
    if not argv:
        sys.stderr.write("usage: python -m splitrun.launcher.bootstrap "
                         "[--parent-pid PID] SCRIPT [ARGS...]\n")
        raise SystemExit(2)
    configure_logging(os.environ.get(_LOG_LEVEL_VARIABLE))
    logging.getLogger(_TORCH_FX_LOGGER).addFilter(_DropIsFxTracingAdvice())
    script = argv[0]
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException as exc:
        job = sys.modules.get("splitrun.runtime.job.job")  # imported by the script if it ran a job
        if job is not None and isinstance(exc, job.PlanWritten):
            raise SystemExit(0) from None
        if job is not None and isinstance(exc, Exception):
            try:
                job.report_uncaught(exc)  # the scheduler learns the error and the step now
            except Exception as report_error:  # noqa: BLE001 - the script's error stays the one shown
                sys.stderr.write(f"splitrun: could not report the error to the job: "
                                 f"{type(report_error).__name__}: {report_error}\n")
        errors = sys.modules.get("splitrun.splitter.errors")
        if (errors is not None and isinstance(exc, errors.SplitrunError)
                and not logging.getLogger().isEnabledFor(logging.DEBUG)):
            # splitrun's own errors say what and where: one line, no traceback
            # (with --log-level DEBUG, the traceback).
            sys.stderr.write(f"{ERROR_MARK}{type(exc).__name__}: {_one_line(exc)}\n")
            _exit_now(1)
        raise
    finally:
        # The script is done (returned, or exits with sys.exit). Teardown frees
        # what is still alive (torch's, gRPC's and the script's objects) by
        # reference counts; the collector's last passes would first walk every one
        # of those hundreds of thousands of objects (seconds on a loaded machine)
        # while the launcher waits for the exit status.
        gc.freeze()


def _exit_now(code: int) -> None:
    """End a failed process without tearing the interpreter down: collecting
    torch's and gRPC's objects takes seconds on a loaded machine, while the
    process's peers and its launcher wait for it to be gone. The script's own
    exit handlers still run."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return " ".join(line.strip() for line in lines) if lines else type(exc).__name__


if __name__ == "__main__":
    main()
