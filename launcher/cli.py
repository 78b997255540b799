"""The `splitrun` command: launch a local cluster, join one, show a plan, or run
a standalone scheduler."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from splitrun.runtime.cluster.env import ENV
from splitrun.runtime.cluster.identity import foreign_identity
from splitrun.runtime.cluster.scheduler import Scheduler, SchedulerSettings
from splitrun.runtime.cluster.step_file import read_step
from splitrun.runtime.errors import ClusterError
from splitrun.runtime.rpc.tls import TlsFiles, check_bind
from splitrun.runtime.transport.shm.job_files import (
    STEP_FILE_SUFFIX,
    job_file_path,
    new_job_prefix,
    remove_job_segments,
)
from splitrun.splitter.errors import SplitrunError
from splitrun.splitter.labels import Label, Role

from . import shm_room
from .child_env import (
    child_env,
    copy_env,
    metrics_env,
    template_env,
    thread_budget,
    thread_env,
    tls_env,
)
from .failures import Outcome, count_of
from .forked import Template
from .options import parse_args
from .process_logs import ProcessLogs
from .render import check_plan_out, read_module_map, render_plan
from .standing_client import SOCKET_VARIABLE, StandingTemplate
from .supervisor import Supervisor

__all__ = ["main", "run", "parse_args"]

logger = logging.getLogger("splitrun.launcher")

# Bounds the search for a restart's checkpoint (reading and hashing its files).
CHECKPOINT_SEARCH_TIMEOUT_S = 600.0


def _tls_of(args, what: str) -> TlsFiles | None:
    """The TLS files given, after checking that an off-loopback bind has TLS."""
    tls = TlsFiles.from_paths(args.tls_cert, args.tls_key, args.tls_ca)
    check_bind(args.host, tls, args.insecure, what)
    return tls


def _read_token_file(path: str) -> str:
    """The token in `path`, a file only its owner may read (0600)."""
    try:
        mode = os.stat(path).st_mode
        with open(path) as data:
            token = data.read().strip()
    except OSError as exc:
        raise ClusterError(f"--token-file {path}: cannot read it: {exc.strerror}") from None
    if mode & 0o077:
        raise ClusterError(f"--token-file {path} is readable by others (mode "
                           f"{stat.S_IMODE(mode):o}); chmod 600 {path}")
    if not token:
        raise ClusterError(f"--token-file {path} is empty")
    return token


def _write_token_file(path: str, token: str) -> None:
    """Write `token` to `path`, readable by its owner only (0600)."""
    if os.path.exists(path):
        os.remove(path)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(token + "\n")


def _export(args) -> int:
    # Imported here, as in the restart loop: torch.distributed.checkpoint costs
    # every launch half a second it does not need.
    from splitrun.runtime.checkpoints import plain as checkpoint
    from splitrun.runtime.checkpoints.sharded import export_checkpoint
    try:
        result = export_checkpoint(args.checkpoint_dir, args.out)
    except SplitrunError as exc:
        print(f"splitrun export: {exc}", file=sys.stderr)
        return 1
    print(f"splitrun export: step {result.get('step')}, {len(result.get('model', {}))} model "
          f"tensors written to {args.out} (checksum in {checkpoint.checksum_path(args.out)})")
    return 0


def new_supervisor(args, template: Template | StandingTemplate | None = None) -> Supervisor:
    """A supervisor for the processes of one start of the job: their lines on
    the console, prefixed, and with --log-dir in one file per process too;
    forked from `template` where given."""
    logs = ProcessLogs(args.log_dir) if getattr(args, "log_dir", None) is not None else None
    return Supervisor(logs=logs, verbose=is_verbose(args), template=template)


def is_verbose(args) -> bool:
    """The launcher's own lifecycle lines are shown (-v, or --log-level INFO/DEBUG)."""
    return logging.getLevelName(args.log_level) <= logging.INFO


def _log_to_dir(args) -> None:
    """With --log-dir, the launcher's own log records go to launcher.log too."""
    if getattr(args, "log_dir", None) is None or args.command == "join":
        return
    handler = logging.StreamHandler(ProcessLogs(args.log_dir).open_launcher())
    handler.setFormatter(logging.Formatter("[splitrun] %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)


def _new_incarnation() -> int:
    # Distinct per start of a job, so a restarted peer's stale messages are refused.
    return time.time_ns() & ((1 << 62) - 1)


def _script_argv(args, *, die_with_launcher: bool) -> list[str]:
    """The command of a process running the user's script: through the
    bootstrap, which sets the process up before the script runs."""
    parent = ["--parent-pid", str(os.getpid())] if die_with_launcher else []
    return [sys.executable, "-m", "splitrun.launcher.bootstrap", *parent, args.script,
            *args.script_args]


def _launch(args) -> int:
    try:
        thread_budget(args.threads_per_process, 1)
    except SplitrunError as exc:
        print(f"splitrun: {exc}", file=sys.stderr)
        return 2
    if args.max_restarts < 0 or (args.checkpoint_every is not None and args.checkpoint_every < 1):
        print("splitrun: need --max-restarts >= 0 and --checkpoint-every >= 1", file=sys.stderr)
        return 2
    try:
        tls = _tls_of(args, "splitrun launch")
    except ClusterError as exc:
        print(f"splitrun: {exc}", file=sys.stderr)
        return 2
    token = secrets.token_hex(16)
    if args.backend == "ray":
        from .ray_backend import launch_on_ray  # imports Ray
        return launch_on_ray(args, tls, token, lambda address, label, shm: {
            **child_env(args, address, token, label, shm), **tls_env(tls)})
    own_dir = args.checkpoint_every is not None and args.checkpoint_dir is None
    directory = (tempfile.mkdtemp(prefix="splitrun-checkpoints-") if own_dir
                 else args.checkpoint_dir)
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
    current: list[Supervisor] = []
    interrupted: list[int] = []

    def on_signal(signum, _frame):
        interrupted.append(signum)
        if current:
            current[-1].interrupt(signum)
    template = _start_template(args)  # imports while the scheduler starts
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        restart_from, attempt = None, 0
        while True:
            supervisor = new_supervisor(args, template)
            current.append(supervisor)
            if interrupted:
                supervisor.interrupt(interrupted[0])
            room = _shm_room(args, supervisor)
            if room is None:  # no room for the rings the job must use: not started
                outcome = Outcome(1, "not started: no room for its shared-memory rings")
                break
            newest = _NewestCheckpoint(directory if attempt < args.max_restarts else None)
            outcome = _run_once(args, token, tls, supervisor, directory, restart_from,
                                on_failure=newest.start, extra_env=room)
            supervisor.say(outcome.summary)
            if outcome.exit_code == 0 or interrupted or attempt >= args.max_restarts:
                break
            attempt += 1
            found = newest.result()
            restart_from = found[0] if found else None
            where = (f"from {found[0]} (step {found[1]})" if found
                     else "from the start (no checkpoint yet)")
            supervisor.say(f"restart {attempt} of {args.max_restarts} {where}; "
                           f"cause: {outcome.summary}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if template is not None:
            template.close()
    if own_dir:
        if outcome.exit_code == 0:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            supervisor.say(f"checkpoints kept in {directory}")
    return outcome.exit_code


def _start_template(args) -> Template | StandingTemplate | None:
    """The template process the job's processes are forked from, started with
    their environment but their own variables (--start-method forkserver)."""
    if args.start_method != "forkserver":
        return None
    env = template_env(thread_budget(args.threads_per_process, args.workers + args.servers))

    def own_template() -> Template | None:
        return Template.start(env, args.script, args.preload)
    standing = args.template or os.environ.get(SOCKET_VARIABLE)
    if not standing:
        return own_template()
    if args.preload:
        logger.info("--preload: this launch starts its own template, not the standing one")
        return own_template()
    return StandingTemplate.connect(standing, {**env, "PYTHONUNBUFFERED": "1"}, args.script,
                                    own_template)


def _shm_room(args, supervisor: Supervisor) -> dict[str, str] | None:
    """The variables this start's processes get for /dev/shm's room: none
    where the rings fit, gRPC where they do not (said, with what to free);
    None where SPLITRUN_TRANSPORT=shm asks for rings there is no room for."""
    problem = shm_room.shortfall(args.workers + args.servers)
    if problem is None:
        return {}
    if os.environ.get(ENV.TRANSPORT, "").strip().lower() == "shm":
        supervisor.say(f"{problem}; {ENV.TRANSPORT}=shm needs them: the job does not start")
        return None
    supervisor.say(f"{problem}; this start's processes talk over gRPC instead")
    return {ENV.TRANSPORT: "grpc"}


class _NewestCheckpoint:
    """The newest good periodic checkpoint in `directory`, for a restart:
    looked for in a thread from the failure's first sign (`start`), while the
    processes are blamed and stopped, since finding it imports torch's
    checkpoint code and verifies every file (seconds on a loaded machine)."""

    def __init__(self, directory: str | None) -> None:
        self._directory = directory
        self._thread: threading.Thread | None = None
        self._found: tuple[str, int] | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        if self._directory is None or self._thread is not None:
            return
        logger.info("the job failed: looking for the newest checkpoint in %s", self._directory)
        self._thread = threading.Thread(target=self._find, daemon=True,
                                        name="newest-checkpoint")
        self._thread.start()

    def _find(self) -> None:
        try:
            from splitrun.runtime.checkpoints import periodic
            self._found = periodic.latest_checkpoint(self._directory)
        except BaseException as exc:  # noqa: BLE001 - raised by result()
            self._error = exc

    def result(self) -> tuple[str, int] | None:
        """(path, step) of the newest good checkpoint, or None."""
        self.start()
        if self._thread is None:
            return None
        self._thread.join(CHECKPOINT_SEARCH_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("no checkpoint found in %s within %g s; restarting from the start",
                           self._directory, CHECKPOINT_SEARCH_TIMEOUT_S)
            return None
        if self._error is not None:
            raise self._error
        return self._found


def _run_once(args, token: str, tls: TlsFiles | None, supervisor: Supervisor,
              checkpoint_dir: str | None, restart_from: str | None,
              on_failure: Callable[[], None] | None = None,
              extra_env: dict[str, str] | None = None):
    """One incarnation of the job: a fresh scheduler (a new incarnation, so
    messages of an earlier one are refused) and every process, whose
    environment gets `extra_env` too."""
    scheduler = Scheduler(SchedulerSettings(args.workers, args.servers, token,
                                            _new_incarnation(),
                                            heartbeat_timeout_s=args.heartbeat_timeout,
                                            stall_timeout_s=args.stall_timeout))
    address = scheduler.start(args.host, 0, tls)
    # Same-host peers share memory under this prefix; whatever a killed
    # process leaves there is removed when this incarnation ends.
    shm_prefix = new_job_prefix()
    logger.info("same-host peers share memory under /dev/shm/%s*", shm_prefix)
    threads = thread_budget(args.threads_per_process, args.workers + args.servers)
    supervisor.note(f"scheduler at {address}; starting {count_of(args.workers, 'worker')} and "
                    f"{count_of(args.servers, 'server')} running {args.script} "
                    f"({count_of(threads, 'thread')} each)")
    extra = {**tls_env(tls), **(extra_env or {})}
    if args.checkpoint_every is not None:
        extra.update({ENV.CHECKPOINT_EVERY: str(args.checkpoint_every),
                      ENV.CHECKPOINT_DIR: checkpoint_dir})
    if restart_from is not None:
        extra[ENV.RESTART_FROM] = restart_from
    # Each process keeps its steps done in a file under the job's prefix: a
    # process killed between two heartbeats is named at the step it reached.
    step_files = {label: job_file_path(shm_prefix, str(label), STEP_FILE_SUFFIX)
                  for label in _labels(args)}

    def step_of(label: Label) -> int | None:
        recorded = read_step(step_files[label]) if label in step_files else None
        return recorded if recorded is not None else scheduler.member_step(label)
    try:
        for local_rank, label in enumerate(_labels(args)):
            env = child_env(args, address, token, label, shm_prefix)
            env.update(extra)
            env[ENV.LOCAL_RANK] = str(local_rank)  # its GPU: cuda:local_rank % GPUs
            env[ENV.STEP_FILE] = step_files[label]
            supervisor.spawn(label, _script_argv(args, die_with_launcher=True), env)
        return supervisor.run(external_failure=lambda: scheduler.failure, step_of=step_of,
                              on_failure=on_failure)
    finally:
        scheduler.stop()
        remove_job_segments(shm_prefix)


def _labels(args) -> list[Label]:
    return ([Label(r, Role.WORKER) for r in range(args.workers)]
            + [Label(r, Role.SERVER) for r in range(args.servers)])


def _plan(args) -> int:
    """Run the script once as worker 0 in plan mode: it writes the plan's text
    form and stops at `job.start()`; then render it as each `--out` asks."""
    outs = args.out or ["plan.dot"]
    try:
        for out in outs:  # refused before the script runs
            check_plan_out(out)
    except SplitrunError as exc:
        print(f"splitrun: {exc}", file=sys.stderr)
        return 2
    supervisor = new_supervisor(args)
    with tempfile.TemporaryDirectory(prefix="splitrun-plan-") as scratch:
        text_path = os.path.join(scratch, "plan.txt")
        modules_path = os.path.join(scratch, "modules.json")
        env = dict(os.environ)
        env.update({ENV.PLAN_OUT: text_path, ENV.PLAN_MODULES_OUT: modules_path,
                    ENV.NUM_WORKERS: str(args.workers),
                    ENV.NUM_SERVERS: str(args.servers), ENV.LOG_LEVEL: args.log_level,
                    "PYTHONUNBUFFERED": "1"})
        env.pop(ENV.SCHEDULER, None)
        supervisor.spawn(Label.worker(0), _script_argv(args, die_with_launcher=True), env)
        outcome = supervisor.run()
        if outcome.exit_code != 0:
            supervisor.say(outcome.summary)
            return outcome.exit_code
        if not os.path.exists(text_path):
            supervisor.say(f"{args.script} exited without writing a plan; does it call "
                           f"Job.from_env() and job.start(program)?")
            return 1
        with open(text_path) as text:
            plan_text = text.read()
        try:
            names = read_module_map(modules_path)
            for out in outs:
                plan = render_plan(plan_text, out, names)
        except SplitrunError as exc:
            supervisor.say(str(exc))
            return 1
    supervisor.say(f"plan written to {', '.join(outs)}\n{plan.summary()}")
    return 0


def _join(args) -> int:
    if args.log_dir is not None:
        print("splitrun: join runs one process in this terminal; keep its output with your "
              "launcher's own option (srun --output=DIR/%t.log) or a redirect; --log-dir "
              "is for splitrun launch", file=sys.stderr)
        return 2
    try:
        tls = _tls_of(args, "splitrun join")
        token = (_read_token_file(args.token_file) if args.token_file
                 else os.environ.get(ENV.TOKEN, ""))
    except ClusterError as exc:
        print(f"splitrun: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.update({ENV.DEVICE: args.device, ENV.HOST: args.host, ENV.LOG_LEVEL: args.log_level})
    if args.scheduler is not None:
        if args.workers is not None or args.servers is not None:
            print("splitrun: --workers/--servers assign roles under srun or torchrun (no "
                  "--scheduler); the scheduler at --scheduler already has the job's size "
                  "(splitrun scheduler --workers/--servers)", file=sys.stderr)
            return 2
        env[ENV.SCHEDULER] = args.scheduler
        env[ENV.ROLE] = args.role or "worker"
    else:
        problem = _identity_env(args, env)
        if problem is not None:
            print(f"splitrun: {problem}", file=sys.stderr)
            return 2
    if not token:
        print(f"splitrun: join needs the job's token: --token-file PATH (the file `splitrun "
              f"scheduler` wrote) or ${ENV.TOKEN}", file=sys.stderr)
        return 2
    env[ENV.TOKEN] = token
    env.update(tls_env(tls))
    env.update(metrics_env(args))
    if args.insecure:
        env[ENV.INSECURE] = "1"
    if args.rank is not None:
        if args.rank < 0:
            print(f"splitrun: --rank {args.rank}: ranks start at 0; leave --rank out to take "
                  f"the next free one", file=sys.stderr)
            return 2
        env[ENV.RANK] = str(args.rank)
    if args.advertise:
        env[ENV.ADVERTISE] = args.advertise
    if args.threads_per_process is not None:
        env.update(thread_env(thread_budget(args.threads_per_process, 1)))
    argv = _script_argv(args, die_with_launcher=False)
    env.update(copy_env())
    os.execvpe(argv[0], argv, env)  # this process becomes the job's process
    return 1  # not reached


def _identity_env(args, env: dict[str, str]) -> str | None:
    """`splitrun join` without --scheduler, under srun or torchrun: put the
    cluster size in `env` (the task number then decides the role, see
    runtime/cluster/identity.py) and check the variables; the problem, or None."""
    env.pop(ENV.SCHEDULER, None)
    if args.workers is not None and args.workers < 1:
        return f"need --workers >= 1, got {args.workers}"
    if args.servers is not None and args.servers < 0:
        return f"need --servers >= 0, got {args.servers}"
    for variable, value in ((ENV.NUM_WORKERS, args.workers), (ENV.NUM_SERVERS, args.servers)):
        if value is not None:
            env[variable] = str(value)
    if args.role is not None:
        env[ENV.ROLE] = args.role
    try:
        identity = foreign_identity(env)
    except ClusterError as exc:
        return str(exc)
    if identity is None:
        return ("join needs --scheduler HOST:PORT, or to run under srun or torchrun "
                "(SLURM_PROCID/SLURM_NTASKS or RANK/WORLD_SIZE set)")
    logger.info("%s; scheduler at %s%s", identity.describe(), identity.scheduler,
                " (hosted by this task)" if identity.hosts_scheduler else "")
    return None


def _scheduler(args) -> int:
    try:
        tls = _tls_of(args, "splitrun scheduler")
    except ClusterError as exc:
        print(f"splitrun: {exc}", file=sys.stderr)
        return 2
    token = os.environ.get(ENV.TOKEN) or secrets.token_hex(16)
    _write_token_file(args.token_file, token)
    scheduler = Scheduler(SchedulerSettings(args.workers, args.servers, token,
                                            _new_incarnation(),
                                            heartbeat_timeout_s=args.heartbeat_timeout,
                                            stall_timeout_s=args.stall_timeout))
    interrupted: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: interrupted.append(signum))
    address = scheduler.start(args.host, args.port, tls)
    print(f"splitrun scheduler at {address}; token in {os.path.abspath(args.token_file)} "
          f"(join with --token-file)", flush=True)
    try:
        while not scheduler.wait_done(timeout_s=0.5):
            if interrupted:  # exit as the launcher does: 128 + the signal
                name = signal.Signals(interrupted[0]).name
                print(f"splitrun scheduler: interrupted by {name}", flush=True)
                return 128 + interrupted[0]
        failure = scheduler.failure
        if failure is not None:
            print(f"splitrun scheduler: job failed: {failure[1]}", flush=True)
            return 1
        print("splitrun scheduler: every process is done", flush=True)
        return 0
    finally:
        scheduler.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="[splitrun] %(levelname)s %(message)s")
    _log_to_dir(args)
    if args.command != "join" and (getattr(args, "workers", 1) < 1
                                   or getattr(args, "servers", 0) < 0):
        print("splitrun: need --workers >= 1 and --servers >= 0", file=sys.stderr)
        return 2
    command = {"launch": _launch, "plan": _plan, "join": _join, "scheduler": _scheduler,
               "export": _export}
    return command[args.command](args)


def run() -> None:
    """The `splitrun` command: `main()`, then exit at once. Every child is
    reaped and every line written by then; tearing down the interpreter (torch,
    gRPC) would only delay the exit status by seconds on a loaded machine."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
