"""A standing template: one template process that many launches share.

    python -m splitrun.launcher.standing_template --serve SOCKET [--threads N]
        [--preload MODULE]... [--parent-pid PID]

A launch's own template (template.py) imports torch and splitrun's job
machinery once per launch: seconds of CPU before the job's first process is
forked. A standing template imports them once for every launch that names its
socket (`splitrun launch --template SOCKET`, or SPLITRUN_TEMPLATE=SOCKET):
each launcher connects (a unix socket, one connection per launcher), says
hello with a pidfd of itself, and asks for its processes; the template forks
them and answers each with the process's pid and a pidfd of it (SCM_RIGHTS: no
pid-reuse race). It serves any number of launchers at once from one thread (a
fork needs that: template.py says why the fork is safe).

Its processes are its children, not the launcher's, so it supervises them for
the launcher (standing_client.py is the launcher's side):

- When one exits, the template tells its launcher the exit code and leaves it
  a zombie until the launcher says `reap`: the launcher signals the process's
  group after it exited (its data-loader workers), and the group id cannot
  have been reused before then.
- When the launcher is gone (its pidfd becomes readable, or its connection
  closes), the template SIGKILLs each of its processes and the process group
  it leads (process_groups.py), then reaps them. A process dies with its
  template too (PR_SET_PDEATHSIG).

It runs what a launcher asks for, so only its own user may connect: the
socket is mode 0600 and a peer of another uid (SO_PEERCRED) is refused. A
launcher whose hello is not answered in time (the template is busy importing
another launcher's modules, or hung) starts its own template.

What a forked process inherits from its parent beyond the environment must
match too: the launcher compares `process_context()` (process_context.py:
namespaces, cgroup, resource limits, CPU affinity, nice value) with the
template's, and starts its own template where they differ (a launch under
`ip netns exec`, `taskset`, `nice`, `prlimit`, in another cgroup); the umask
comes with each request.

The environment: it starts with the one a launch would give its own template
(child_env.template_env: the thread budget, glibc's copy tunables, unbuffered
output), by executing itself once more with it, since some of it is read when
a process starts. A launch whose environment differs beyond splitrun's own
variables uses its own template instead (the launcher compares them). The
installed modules a launched script imports first are imported here too when
its launcher says hello, as a launch's own template does; the user's own
modules are not (another launch's script may have a module of the same name).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import struct
import sys
import traceback
from dataclasses import dataclass, field

from .child_env import template_env, thread_budget
from .process_context import process_context
from .process_groups import signal_with_group
from .template import (
    MAX_MESSAGE_BYTES,
    PRELOAD,
    collected_once,
    fork_problem,
    preload_modules,
    preload_script_imports,
    probe_fork,
    run_forked,
    set_up_process,
)

__all__ = ["main", "SERVING"]

# Set in the environment the template executes itself with (child_env.template_env):
# splitrun's own, so the launchers' comparison ignores it.
_IN_LAUNCH_ENV = "SPLITRUN_STANDING_TEMPLATE_ENV"
# Bounds a message to a launcher that does not read (stopped): it is dropped.
SEND_TIMEOUT_S = 10.0
# The line the template prints once it listens (its starter may wait for it).
SERVING = "standing template serving"


@dataclass
class _Launcher:
    """One connected launcher and the processes forked for it (pid -> pidfd),
    those of them that exited but are not reaped yet."""
    connection: socket.socket | None
    pidfd: int | None = None
    children: dict[int, int] = field(default_factory=dict)
    exited: set[int] = field(default_factory=set)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if os.environ.get(_IN_LAUNCH_ENV) != "1":
        _execute_in_launch_env(args, argv)
    if args.parent_pid is not None:
        from .bootstrap import die_with_parent  # the standard library only

        die_with_parent(args.parent_pid)
    env = dict(os.environ)  # before the imports (torch's set variables of their own)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    previous = os.umask(0o177)  # the socket is its user's only (connect needs write)
    try:
        listener.bind(args.serve)
    except OSError as exc:
        raise SystemExit(f"splitrun: cannot listen on {args.serve}: {exc.strerror} (a path "
                         f"left by a killed template: remove it; one in use: another "
                         f"template serves there)") from None
    finally:
        os.umask(previous)
    listener.listen(64)
    # Neither the folder this started in nor a script's: the user's own modules
    # are not imported here (a forked process's bootstrap sets its own path[0]).
    sys.path[0] = os.path.dirname(os.path.abspath(args.serve))
    # Launchers may connect from now on; their hellos are answered after the imports.
    print(f"{SERVING} {args.serve} (pid {os.getpid()})", flush=True)
    preload = [*PRELOAD, *args.preload]
    with collected_once():
        problem = preload_modules(tuple(preload)) or probe_fork() or fork_problem()
    print(f"unusable: {problem}" if problem else f"imported {', '.join(preload)}", flush=True)
    bootstrap_args = _Server(listener, problem, env, preload).serve()
    run_forked(bootstrap_args)  # in a forked process only: the server loop never returns


def _execute_in_launch_env(args: argparse.Namespace, argv: list[str]) -> None:
    """Run this command again with the environment a launch's own template
    would have (read in part when a process starts: glibc's tunables)."""
    env = {**template_env(thread_budget(args.threads, 1)), "PYTHONUNBUFFERED": "1",
           _IN_LAUNCH_ENV: "1"}
    os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *argv], env)


class _Server:
    def __init__(self, listener: socket.socket, problem: str | None,
                 env: dict[str, str], preloaded: list[str]) -> None:
        self._listener = listener
        self._env = env
        self._preloaded = preloaded  # what it imported so far
        self._problem = problem
        self._launchers: list[_Launcher] = []
        self._pid = os.getpid()  # a forked process's parent

    def serve(self) -> list[str]:
        """Serve until killed; returns in a forked process only: its
        bootstrap's arguments."""
        while True:
            handlers = {self._listener.fileno(): self._accept}
            for launcher in self._launchers:
                if launcher.connection is not None:
                    handlers[launcher.connection.fileno()] = \
                        lambda launcher=launcher: self._receive(launcher)
                if launcher.pidfd is not None:
                    handlers[launcher.pidfd] = lambda launcher=launcher: self._drop(launcher)
                for pid, pidfd in launcher.children.items():
                    if pid not in launcher.exited:
                        handlers[pidfd] = lambda launcher=launcher, pid=pid: \
                            self._exited(launcher, pid)
            poller = select.poll()  # not select(): a busy template may hold fds past 1024
            for fd in handlers:
                poller.register(fd, select.POLLIN)
            # Waits for the next event however long: the template serves until killed.
            for fd, _ in poller.poll():
                forked = handlers[fd]()
                if forked is not None:
                    return forked
            self._launchers = [launcher for launcher in self._launchers
                               if launcher.connection is not None or launcher.children]

    def _accept(self) -> None:
        connection, _ = self._listener.accept()
        credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                            struct.calcsize("3i"))
        if struct.unpack("3i", credentials)[1] != os.getuid():
            connection.close()  # it runs what it is asked to: its own user's launches only
            return
        connection.settimeout(SEND_TIMEOUT_S)
        self._launchers.append(_Launcher(connection))

    def _receive(self, launcher: _Launcher) -> list[str] | None:
        if launcher.connection is None:  # dropped earlier in this round
            return None
        try:
            message, fds, _, _ = socket.recv_fds(launcher.connection, MAX_MESSAGE_BYTES, 1)
            request = json.loads(message) if message else None
        except (OSError, ValueError):
            request, fds = None, []
        if not isinstance(request, dict):  # closed, or not ours
            for fd in fds:
                os.close(fd)
            self._drop(launcher)
            return None
        if "hello" in request:
            self._hello(launcher, request["hello"], fds)
        elif "fork" in request:
            return self._fork(launcher, request["fork"], fds)
        elif "reap" in request:
            self._reap(launcher, request["reap"])
        return None

    def _hello(self, launcher: _Launcher, hello: dict, fds: list[int]) -> None:
        if len(fds) != 1:
            self._send(launcher, {"unusable": "the launcher's hello came without its pidfd"})
            return
        launcher.pidfd = fds[0]
        if self._problem is None and hello.get("script"):
            with collected_once():
                self._preloaded += preload_script_imports(hello["script"])
                # A module imported now may have started a thread.
                self._problem = probe_fork() or fork_problem()
        if self._problem is not None:
            self._send(launcher, {"unusable": self._problem})
        else:
            self._send(launcher, {"ready": {"pid": os.getpid(), "env": self._env,
                                            "context": process_context(),
                                            "preloaded": self._preloaded}})

    def _fork(self, launcher: _Launcher, request: dict, fds: list[int]) -> list[str] | None:
        problem = ("the request came without an output pipe" if len(fds) != 1
                   else self._problem or fork_problem())
        if problem is not None or launcher.pidfd is None:
            for fd in fds:
                os.close(fd)
            self._send(launcher, {"exec": problem or "the launcher did not say hello"})
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return self._become_process(request, fds[0])
        os.close(fds[0])
        pidfd = os.pidfd_open(pid)  # not reaped before the launcher says so: no reuse
        launcher.children[pid] = pidfd
        self._send(launcher, {"pid": pid}, [pidfd])
        return None

    def _become_process(self, request: dict, out_fd: int) -> list[str]:
        """In the forked process: die with the template, close what the
        template holds, set up as a process the launcher started."""
        try:
            from .bootstrap import die_with_parent

            die_with_parent(self._pid)
            self._listener.close()
            for launcher in self._launchers:
                if launcher.connection is not None:
                    launcher.connection.close()
                for fd in (launcher.pidfd, *launcher.children.values()):
                    if fd is not None:
                        os.close(fd)
            set_up_process(request, out_fd)
            os.umask(request["umask"])
            args = list(request["argv"][3:])
            if args[:1] == ["--parent-pid"]:
                args = args[2:]  # its parent is this template: it watches the launcher
            return args
        except BaseException:  # noqa: BLE001 - never return into the template's loop
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    def _exited(self, launcher: _Launcher, pid: int) -> None:
        """Tell the launcher its process exited; reap it once the launcher says
        so (or now, where no launcher is left to say it)."""
        if pid not in launcher.children or pid in launcher.exited:  # handled this round
            return
        launcher.exited.add(pid)
        if launcher.connection is None:
            self._reap(launcher, pid)
            return
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        self._send(launcher, {"exited": pid, "code": code})

    def _reap(self, launcher: _Launcher, pid: object) -> None:
        if pid not in launcher.exited:  # not ours, or not exited yet: reaping would block
            return
        os.waitpid(pid, 0)
        os.close(launcher.children.pop(pid))
        launcher.exited.discard(pid)

    def _drop(self, launcher: _Launcher) -> None:
        """The launcher is gone or closed its connection: its processes go
        (their groups SIGKILLed), and are reaped as they exit."""
        if launcher.connection is not None:
            launcher.connection.close()
            launcher.connection = None
        if launcher.pidfd is not None:
            os.close(launcher.pidfd)
            launcher.pidfd = None
        for pid in list(launcher.children):
            signal_with_group(pid, signal.SIGKILL)
            if pid in launcher.exited:
                self._reap(launcher, pid)

    def _send(self, launcher: _Launcher, message: dict, fds: list[int] = ()) -> None:
        try:
            socket.send_fds(launcher.connection, [json.dumps(message).encode()], list(fds))
        except OSError:  # gone, or not reading: it gets no more answers
            self._drop(launcher)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m splitrun.launcher.standing_template")
    parser.add_argument("--serve", required=True, metavar="SOCKET",
                        help="the path of the unix socket to listen on (must not exist)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="the intra-op threads of the launches it serves (default as "
                             "`splitrun launch`: OMP_NUM_THREADS, else this machine's cores)")
    parser.add_argument("--preload", action="append", default=[], metavar="MODULE",
                        help="also import this installed module")
    parser.add_argument("--parent-pid", type=int, default=None, metavar="PID",
                        help="exit with this process (its parent)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
