"""The `splitrun` command: launch a local cluster, join one, show a plan, or run
a standalone scheduler."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import time

from splitrun.runtime.cluster.env import ENV
from splitrun.runtime.cluster.identity import foreign_identity
from splitrun.runtime.cluster.scheduler import Scheduler, SchedulerSettings
from splitrun.runtime.cluster.step_file import read_step
from splitrun.runtime.errors import ClusterError
from splitrun.runtime.rpc.tls import TlsFiles, check_bind
from splitrun.runtime.transport.shm.copy_tunables import glibc_tunables_for_copies
from splitrun.runtime.transport.shm.job_files import (
    STEP_FILE_SUFFIX,
    job_file_path,
    new_job_prefix,
    remove_job_segments,
)
from splitrun.splitter.errors import SplitrunError
from splitrun.splitter.labels import Label, Role

from .forked import Template
from .process_logs import ProcessLogs, Tee
from .render import check_plan_out, read_module_map, render_plan
from .supervisor import Supervisor

# A silent process is named within this long (plus a poll): fast, and still
# several heartbeats (every 0.5 s) on a loaded machine.
HEARTBEAT_TIMEOUT_S = 3.0
# A live process that holds up its peers this long is named (a busy loop).
STALL_TIMEOUT_S = 20.0

__all__ = ["main", "run", "parse_args"]

logger = logging.getLogger("splitrun.launcher")

_EPILOG_LAUNCH = """\
example:
  splitrun launch --workers 3 examples/pipeline_split.py --steps 50
  splitrun launch --workers 2 --servers 1 examples/ps_train.py
  splitrun launch --workers 2 --max-restarts 2 --checkpoint-every 100 train.py
  splitrun launch --backend ray --workers 2 --servers 1 examples/ps_train.py
  splitrun launch --backend ray --address HEAD:6379 --host 0.0.0.0 --insecure \\
      --workers 4 --servers 2 --worker-resources '{"CPU": 2, "GPU": 1}' train.py

Every process runs SCRIPT; its output lines are prefixed with the process
("[worker 1] ..."). Shown: the driver's progress, what the script prints,
warnings and errors (-v: every process's lifecycle too). On the first failure
the others are stopped and the launcher exits with the failing process's code.
With --max-restarts N the whole job then starts again (a new incarnation) from
the last good checkpoint that --checkpoint-every K wrote, up to N times; the
script resumes at trainer.steps_done (local backend only).
"""

_EPILOG_PLAN = """\
example:
  splitrun plan --workers 3 --out plan.dot examples/pipeline_split.py
  dot -Tsvg plan.dot -o plan.svg     # or --out plan.svg where graphviz is installed

Runs SCRIPT once in plan mode: its Job.start() writes the plan instead of
training. .dot (the default; or .gv), .svg (needs graphviz) or .txt (the text
form); repeat --out for several from the one run (--out plan.txt --out plan.dot).
"""

_EPILOG_JOIN = """\
example (two machines, one scheduler; TLS files made for both machines' names):
  machine-a$ splitrun scheduler --workers 2 --servers 1 --host 0.0.0.0 --port 29400 \\
                 --token-file job.token --tls-cert a.pem --tls-key a.key --tls-ca ca.pem
  machine-a$ splitrun join --scheduler machine-a:29400 --token-file job.token \\
                 --role server --host 0.0.0.0 --advertise machine-a \\
                 --tls-cert a.pem --tls-key a.key --tls-ca ca.pem train.py
  machine-b$ splitrun join --scheduler machine-a:29400 --token-file job.token \\
                 --role worker --host 0.0.0.0 --advertise machine-b \\
                 --tls-cert b.pem --tls-key b.key --tls-ca ca.pem train.py

Runs one process of a job whose scheduler was started elsewhere (by
`splitrun scheduler`, under Slurm, Kubernetes, or a shell loop). Copy the
token file (mode 0600) to each machine; the token never goes on a command
line. Off loopback, TLS is required unless you pass --insecure.

under Slurm or torchrun (no --scheduler), every task runs the same command:
  export SPLITRUN_TOKEN=$(openssl rand -hex 16)
  srun -n 3 splitrun join --workers 2 --servers 1 --host 0.0.0.0 --insecure train.py
  torchrun --nproc-per-node 3 -m splitrun join --workers 2 --servers 1 train.py
Tasks 0..W-1 are the workers, the rest the servers; task 0 hosts the
scheduler at MASTER_ADDR (else the first node of the Slurm step), port
SPLITRUN_SCHEDULER_PORT, else MASTER_PORT + 1, else 20000 + SLURM_JOB_ID % 10000.
Each process uses the GPU of its local rank (cuda:LOCAL_RANK modulo the GPUs).
"""

_EPILOG_SCHEDULER = """\
example:
  splitrun scheduler --workers 2 --servers 1 --port 29400 --token-file job.token

Writes the job's token to --token-file (mode 0600; processes join with
--token-file), prints its address, then serves until every process of the
job is done (exit 0) or the job failed (exit 1); SIGINT exits 130, SIGTERM
143. A join that cannot be part of the job (a rank taken or out of range, a
role it does not have, an address it cannot reach) is refused; the job goes on.
"""


def _add_cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=1,
                        help="number of worker processes (default %(default)s)")
    parser.add_argument("--servers", type=int, default=0,
                        help="number of server processes (default %(default)s)")


def _add_tls_args(parser: argparse.ArgumentParser) -> None:
    tls = parser.add_argument_group(
        "TLS", "needed to listen on an address other than loopback (or --insecure)")
    tls.add_argument("--tls-cert", default=None, help="this machine's certificate (PEM)")
    tls.add_argument("--tls-key", default=None, help="its private key (PEM)")
    tls.add_argument("--tls-ca", default=None,
                     help="the CA that signed every process's certificate (PEM)")
    tls.add_argument("--insecure", action="store_true",
                     help="listen off loopback without TLS (a network you trust)")


def _tls_of(args, what: str) -> TlsFiles | None:
    """The TLS files given, after checking that an off-loopback bind has TLS."""
    tls = TlsFiles.from_paths(args.tls_cert, args.tls_key, args.tls_ca)
    check_bind(args.host, tls, args.insecure, what)
    return tls


def _tls_env(tls: TlsFiles | None) -> dict[str, str]:
    if tls is None:
        return {}
    return {ENV.TLS_CERT: os.path.abspath(tls.cert), ENV.TLS_KEY: os.path.abspath(tls.key),
            ENV.TLS_CA: os.path.abspath(tls.ca)}


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


def _default_device() -> str:
    """`--device`'s default: the environment's SPLITRUN_DEVICE (the variable the
    launcher sets for its processes), else auto. A machine's or a test suite's
    choice without repeating the flag."""
    return os.environ.get(ENV.DEVICE) or "auto"  # each process checks it (pick_device)


def _add_stall_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stall-timeout", type=float, default=STALL_TIMEOUT_S, metavar="S",
                        help="seconds a process may not advance its step while a peer waits "
                             "on it inside a step, before it counts as stalled (default "
                             "%(default)g)")


def _add_ray_args(parser: argparse.ArgumentParser) -> None:
    ray = parser.add_argument_group(
        "Ray", "--backend ray runs each process as a Ray actor (pip install 'splitrun[ray]')")
    ray.add_argument("--backend", default="local", choices=["local", "ray"],
                     help="local: child processes of this launcher (default); ray: one "
                          "Ray actor per process in one placement group")
    ray.add_argument("--address", default=None,
                     help="the Ray cluster: auto, or HOST:PORT (default: $RAY_ADDRESS, "
                          "else a new local cluster, sized to the job)")
    ray.add_argument("--worker-resources", default=None, metavar="JSON",
                     help='each worker\'s Ray resources, e.g. \'{"CPU": 1, "GPU": 1}\' '
                          '(default {"CPU": 1})')
    ray.add_argument("--server-resources", default=None, metavar="JSON",
                     help='each server\'s Ray resources, e.g. \'{"CPU": 2, "memory": 4e9}\' '
                          '(default {"CPU": 1})')


def _add_script_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("script", help="the training script every process runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments passed to the script (splitrun's own options go "
                             "before SCRIPT)")


# splitrun's global options and their defaults. They are accepted before the
# subcommand (`splitrun --log-level DEBUG launch ...`) and after it (`splitrun
# launch --log-level DEBUG ...`); given in both places, the later one wins.
_GLOBAL_DEFAULTS = {"log_level": None, "verbose": 0, "log_dir": None, "metrics_dir": None}
# What -v asks for: none, the processes' and the launcher's lifecycle (INFO), everything.
_VERBOSITY = ("WARNING", "INFO", "DEBUG")


def _global_options(*, in_subcommand: bool) -> argparse.ArgumentParser:
    """The global options as an argparse parent. The copy inside each
    subcommand has no defaults (SUPPRESS), so it only overrides what was
    given before the subcommand when it is given itself."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("global options (before or after the subcommand)")

    def default(name: str):
        return argparse.SUPPRESS if in_subcommand else _GLOBAL_DEFAULTS[name]
    group.add_argument("-v", "--verbose", action="count", default=default("verbose"),
                       help="also show every process's and the launcher's lifecycle (which "
                            "process started where, transports, byte counters); -vv: debug "
                            "detail. Without it: the progress, the results, warnings and "
                            "errors")
    group.add_argument("--log-level", default=default("log_level"),
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="the log level itself (wins over -v)")
    group.add_argument("--log-dir", default=default("log_dir"), metavar="DIR",
                       help="also write each process's output to DIR/<process>.log "
                            "(worker0.log, server0.log; appended across restarts) and the "
                            "launcher's own lines to DIR/launcher.log")
    group.add_argument("--metrics-dir", default=default("metrics_dir"), metavar="DIR",
                       help="each process writes TensorBoard scalars (loss, steps/s, bytes "
                            "and receive wait per channel, cache hit rates) to "
                            "DIR/<process>/; view with `tensorboard --logdir DIR` (needs "
                            "pip install 'splitrun[metrics]')")
    return parent


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitrun", parents=[_global_options(in_subcommand=False)],
        description="Run one PyTorch training step split across processes.")
    commands = parser.add_subparsers(dest="command", required=True)
    sub_globals = _global_options(in_subcommand=True)

    launch = commands.add_parser(
        "launch", help="start a local cluster and supervise it", parents=[sub_globals],
        description="Start the scheduler and W workers + S servers: child processes on this\n"
                    "machine, or Ray actors on a Ray cluster with --backend ray.",
        epilog=_EPILOG_LAUNCH, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_cluster_args(launch)
    launch.add_argument("--device", default=_default_device(), choices=["auto", "cpu", "cuda"],
                        help="device of every process (auto: cuda when available; default "
                             f"${ENV.DEVICE} or auto)")
    launch.add_argument("--host", default="127.0.0.1",
                        help="interface the scheduler and processes bind (default 127.0.0.1)")
    _add_stall_arg(launch)
    _add_tls_args(launch)
    launch.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S,
                        metavar="S", help="seconds without a heartbeat before a process "
                                          "counts as lost (default %(default)g; one every "
                                          "0.5 s)")
    launch.add_argument("--max-restarts", type=int, default=0,
                        help="after a failure, restart the whole job (from its last good "
                             "checkpoint, with --checkpoint-every) up to N times")
    launch.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                        help="the workers save the job every K steps (Trainer.save)")
    launch.add_argument("--checkpoint-dir", default=None,
                        help="where --checkpoint-every saves (default: a temporary "
                             "directory, removed when the job succeeds)")
    launch.add_argument("--recv-timeout", type=float, default=None, metavar="S",
                        help="seconds a receive inside a step waits for its message (default "
                             "120)")
    launch.add_argument("--threads-per-process", type=int, default=None, metavar="N",
                        help="intra-op threads of each process (default: local backend, this "
                             "machine's cores divided by its processes; Ray, the process's "
                             "CPU resource; at least 1); OMP_NUM_THREADS/MKL_NUM_THREADS set "
                             "by you win")
    launch.add_argument("--start-method", default="forkserver", choices=["forkserver", "exec"],
                        help="local backend: forkserver (default), every process is forked "
                             "from one template process that imported torch and splitrun "
                             "once (seconds faster); exec, each starts a fresh interpreter "
                             "(for a script that sets variables such as OMP_NUM_THREADS "
                             "before it imports torch)")
    launch.add_argument("--preload", action="append", default=[], metavar="MODULE",
                        help="forkserver: also import MODULE in the template (the script's "
                             "folder first on the path), e.g. your model's heavy imports; "
                             "repeatable (the installed modules the script imports first "
                             "are imported there anyway)")
    _add_ray_args(launch)
    _add_script_args(launch)

    plan = commands.add_parser(
        "plan", help="write the split plan without running it", parents=[sub_globals],
        description="Show how SCRIPT's step would be split.",
        epilog=_EPILOG_PLAN, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_cluster_args(plan)
    plan.add_argument("--out", action="append", default=None, metavar="PATH",
                      help="plan.dot, plan.svg or plan.txt, the form by the suffix; "
                           "repeatable, all written from one run (default plan.dot)")
    _add_script_args(plan)

    join = commands.add_parser(
        "join", help="run one process of a job started elsewhere", parents=[sub_globals],
        description="Join the job of the scheduler at --scheduler, or, under srun or "
                    "torchrun, the job their variables describe (task 0 hosts the "
                    "scheduler).",
        epilog=_EPILOG_JOIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    join.add_argument("--scheduler", default=None,
                      help="HOST:PORT of the scheduler (default under srun or torchrun: "
                           "task 0 hosts it at MASTER_ADDR, else the first node of the "
                           "Slurm step; see README)")
    join.add_argument("--workers", type=int, default=None,
                      help="under srun/torchrun: tasks 0..W-1 are the workers "
                           "(default: every task that is not a server)")
    join.add_argument("--servers", type=int, default=None,
                      help="under srun/torchrun: the last S tasks are the servers (default 0)")
    join.add_argument("--token-file", default=None,
                      help=f"a file (mode 0600) holding the job's token, as `splitrun "
                           f"scheduler` wrote it (default: ${ENV.TOKEN}); never on the "
                           f"command line, where `ps` shows it")
    join.add_argument("--role", default=None, choices=["worker", "server"],
                      help="with --scheduler (default worker); under srun/torchrun the task "
                           "number decides")
    join.add_argument("--rank", type=int, default=None, help="rank to ask for (default: next free)")
    join.add_argument("--device", default=_default_device(), choices=["auto", "cpu", "cuda"],
                      help=f"this process's device (default ${ENV.DEVICE} or auto)")
    join.add_argument("--host", default="127.0.0.1",
                      help="interface this process's tensor server binds")
    join.add_argument("--advertise", default=None,
                      help="name peers use to reach this process (default: --host)")
    _add_tls_args(join)
    join.add_argument("--threads-per-process", type=int, default=None, metavar="N",
                      help="intra-op threads of this process (default: torch's, or "
                           "OMP_NUM_THREADS)")
    _add_script_args(join)

    scheduler = commands.add_parser(
        "scheduler", help="run a standalone scheduler for `splitrun join`",
        parents=[sub_globals],
        description="Run the membership service of one job.",
        epilog=_EPILOG_SCHEDULER, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_cluster_args(scheduler)
    scheduler.add_argument("--host", default="127.0.0.1")
    scheduler.add_argument("--port", type=int, default=0, help="0 picks a free port")
    scheduler.add_argument("--token-file", default="splitrun.token",
                           help=f"where to write the job's token, readable by you only "
                                f"(0600); it is ${ENV.TOKEN} if set, else a fresh random one")
    _add_stall_arg(scheduler)
    _add_tls_args(scheduler)
    scheduler.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S,
                           metavar="S", help="seconds without a heartbeat before a process "
                                             "counts as lost (default %(default)g)")

    export = commands.add_parser(
        "export", help="turn a sharded checkpoint directory into one plain file",
        description="Read the sharded checkpoint CKPT_DIR (Trainer.save to a directory; every "
                    "process's files gathered into it) and write one plain checkpoint file, "
                    "loadable with torch.load and load_state_dict (and by resume=).")
    export.add_argument("checkpoint_dir", metavar="CKPT_DIR")
    export.add_argument("out", metavar="OUT.pt")
    return parser


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


def new_supervisor(args, template: Template | None = None) -> Supervisor:
    """A supervisor for the processes of one start of the job: their lines on
    the console, prefixed, and with --log-dir in one file per process too;
    forked from `template` where given."""
    verbose = is_verbose(args)
    if getattr(args, "log_dir", None) is None:
        return Supervisor(verbose=verbose, template=template)
    logs = ProcessLogs(args.log_dir)
    return Supervisor(out=Tee(sys.stdout, logs.open_launcher()), logs=logs, verbose=verbose,
                      template=template)


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


def thread_budget(requested: int | None, num_local_processes: int) -> int:
    """Intra-op threads per process: as asked, else OMP_NUM_THREADS where the
    user set it, else the cores shared out among the processes on this
    machine. torch's default (every core in every process) oversubscribes the
    machine as soon as two processes compute."""
    if requested is not None:
        if requested < 1:
            raise SplitrunError(f"--threads-per-process must be >= 1, got {requested}")
        return requested
    user = os.environ.get("OMP_NUM_THREADS", "")
    if user.isdigit() and int(user) >= 1:
        return int(user)
    return max(1, (os.cpu_count() or 1) // max(1, num_local_processes))


def _thread_env(threads: int) -> dict[str, str]:
    env = {ENV.THREADS: str(threads)}
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if variable not in os.environ:
            env[variable] = str(threads)
    return env


def _copy_env() -> dict[str, str]:
    """Large copies (a message into or out of a shared-memory ring) bypass
    the caches (`glibc_tunables_for_copies`): set where a process starts."""
    return {"GLIBC_TUNABLES": glibc_tunables_for_copies(os.environ.get("GLIBC_TUNABLES"))}


def _child_env(args, address: str, token: str, label: Label,
               shm_prefix: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(_thread_env(thread_budget(args.threads_per_process,
                                         args.workers + args.servers)))
    env.update(_copy_env())
    env.update({ENV.SCHEDULER: address, ENV.TOKEN: token, ENV.ROLE: label.role.value,
                ENV.RANK: str(label.rank), ENV.DEVICE: args.device, ENV.HOST: args.host,
                ENV.LOG_LEVEL: args.log_level, ENV.HEARTBEAT_TIMEOUT_S: str(args.heartbeat_timeout),
                "PYTHONUNBUFFERED": "1"})
    if args.recv_timeout is not None:
        env[ENV.RECV_TIMEOUT_S] = str(args.recv_timeout)
    if shm_prefix is not None:
        env[ENV.SHM_PREFIX] = shm_prefix
    env.update(_metrics_env(args))
    return env


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
            **_child_env(args, address, token, label, shm), **_tls_env(tls)})
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
            outcome = _run_once(args, token, tls, supervisor, directory, restart_from)
            supervisor.say(outcome.summary)
            if outcome.exit_code == 0 or interrupted or attempt >= args.max_restarts:
                break
            attempt += 1
            from splitrun.runtime.checkpoints import periodic as periodic_checkpoints
            found = periodic_checkpoints.latest_checkpoint(directory) if directory else None
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


def _start_template(args) -> Template | None:
    """The template process the job's processes are forked from, started with
    their environment but their own variables (--start-method forkserver)."""
    if args.start_method != "forkserver":
        return None
    env = dict(os.environ)
    env.update(_thread_env(thread_budget(args.threads_per_process, args.workers + args.servers)))
    env.update(_copy_env())
    return Template.start(env, args.script, args.preload)


def _run_once(args, token: str, tls: TlsFiles | None, supervisor: Supervisor,
              checkpoint_dir: str | None, restart_from: str | None):
    """One incarnation of the job: a fresh scheduler (a new incarnation, so
    messages of an earlier one are refused) and every process."""
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
    supervisor.note(f"scheduler at {address}; starting {args.workers} workers and "
                   f"{args.servers} servers running {args.script} ({threads} threads each)")
    extra = _tls_env(tls)
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
            env = _child_env(args, address, token, label, shm_prefix)
            env.update(extra)
            env[ENV.LOCAL_RANK] = str(local_rank)  # its GPU: cuda:local_rank % GPUs
            env[ENV.STEP_FILE] = step_files[label]
            supervisor.spawn(label, _script_argv(args, die_with_launcher=True), env)
        return supervisor.run(external_failure=lambda: scheduler.failure, step_of=step_of)
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
    env.update(_tls_env(tls))
    env.update(_metrics_env(args))
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
        env.update(_thread_env(thread_budget(args.threads_per_process, 1)))
    argv = _script_argv(args, die_with_launcher=False)
    env.update(_copy_env())
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


def _metrics_env(args) -> dict[str, str]:
    if args.metrics_dir is None:
        return {}
    return {ENV.METRICS_DIR: os.path.abspath(args.metrics_dir)}


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, its log level resolved: --log-level, else -v's."""
    args = _parser().parse_args(argv)
    if args.log_level is None:
        args.log_level = _VERBOSITY[min(args.verbose, len(_VERBOSITY) - 1)]
    return args


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
