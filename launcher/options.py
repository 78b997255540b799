"""The `splitrun` command line: its global options (accepted before and after
the sub-command) and each sub-command's options, with their defaults and
examples; `parse_args` resolves the log level."""

from __future__ import annotations

import argparse
import os

from splitrun.runtime.cluster.env import ENV

__all__ = ["parse_args", "build_parser", "HEARTBEAT_TIMEOUT_S", "STALL_TIMEOUT_S"]

# A silent process is named within this long (plus a poll): fast, and still
# several heartbeats (every 0.5 s) on a loaded machine.
HEARTBEAT_TIMEOUT_S = 3.0
# A live process that holds up its peers this long is named (a busy loop).
STALL_TIMEOUT_S = 20.0


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


def build_parser() -> argparse.ArgumentParser:
    """The `splitrun` command line: global options, then one sub-command."""
    parser = argparse.ArgumentParser(
        prog="splitrun", parents=[_global_options(in_subcommand=False)],
        description="Run one PyTorch training step split across processes.")
    commands = parser.add_subparsers(dest="command", required=True)
    sub_globals = _global_options(in_subcommand=True)
    for add in (_add_launch, _add_plan, _add_join, _add_scheduler, _add_export):
        add(commands, sub_globals)
    return parser


def _add_launch(commands, sub_globals: argparse.ArgumentParser) -> None:
    """`splitrun launch`: a cluster of W workers and S servers, supervised."""
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
    _add_failure_args(launch)
    _add_start_args(launch)
    _add_ray_args(launch)
    _add_script_args(launch)


def _add_failure_args(launch: argparse.ArgumentParser) -> None:
    """How launch tells that a process is lost, and restarts the job from a checkpoint."""
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


def _add_start_args(launch: argparse.ArgumentParser) -> None:
    """How the local backend starts the processes: threads, fork or exec, the template."""
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
    launch.add_argument("--template", default=None, metavar="SOCKET",
                        help="forkserver: fork the processes from the standing template "
                             "listening at SOCKET (python -m splitrun.launcher."
                             "standing_template --serve SOCKET), shared by many launches; "
                             "default: $SPLITRUN_TEMPLATE, else a template of this launch's own")


def _add_plan(commands, sub_globals: argparse.ArgumentParser) -> None:
    """`splitrun plan`: write the split plan without running it."""
    plan = commands.add_parser(
        "plan", help="write the split plan without running it", parents=[sub_globals],
        description="Show how SCRIPT's step would be split.",
        epilog=_EPILOG_PLAN, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_cluster_args(plan)
    plan.add_argument("--out", action="append", default=None, metavar="PATH",
                      help="plan.dot, plan.svg or plan.txt, the form by the suffix; "
                           "repeatable, all written from one run (default plan.dot)")
    _add_script_args(plan)


def _add_join(commands, sub_globals: argparse.ArgumentParser) -> None:
    """`splitrun join`: one process of a job started elsewhere."""
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


def _add_scheduler(commands, sub_globals: argparse.ArgumentParser) -> None:
    """`splitrun scheduler`: the membership service of one job, alone."""
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


def _add_export(commands, sub_globals: argparse.ArgumentParser) -> None:
    """`splitrun export`: a sharded checkpoint directory as one plain file."""
    export = commands.add_parser(
        "export", help="turn a sharded checkpoint directory into one plain file",
        description="Read the sharded checkpoint CKPT_DIR (Trainer.save to a directory; every "
                    "process's files gathered into it) and write one plain checkpoint file, "
                    "loadable with torch.load and load_state_dict (and by resume=).")
    export.add_argument("checkpoint_dir", metavar="CKPT_DIR")
    export.add_argument("out", metavar="OUT.pt")


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


def _default_device() -> str:
    """`--device`'s default: the environment's SPLITRUN_DEVICE (the variable the
    launcher sets for its processes), else auto. A machine's or a test suite's
    choice without repeating the flag."""
    return os.environ.get(ENV.DEVICE) or "auto"  # each process checks it (pick_device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, its log level resolved: --log-level, else -v's."""
    args = build_parser().parse_args(argv)
    if args.log_level is None:
        args.log_level = _VERBOSITY[min(args.verbose, len(_VERBOSITY) - 1)]
    return args


