"""How long a job's waits may last, and where it checkpoints and records
metrics: the launcher's settings, read from this process's environment."""

from __future__ import annotations

from dataclasses import dataclass

from ..cluster.env import ProcessEnvironment

__all__ = ["JobSettings"]


@dataclass(frozen=True)
class JobSettings:
    # A receive inside a step waits this long for its message.
    recv_timeout_s: float = 120.0
    # A server's first receive of a step waits this long: workers may spend a
    # while between steps (evaluation, checkpoints). Liveness comes from
    # heartbeats meanwhile.
    idle_timeout_s: float = 3600.0
    # Peers must all register within this long.
    register_timeout_s: float = 120.0
    # The scheduler unreachable this long fails this process.
    heartbeat_timeout_s: float = 3.0
    # Flushing sends and the final barrier are bounded by this.
    finish_timeout_s: float = 120.0
    # `splitrun launch --checkpoint-every K`: the workers save the job every K
    # steps into `checkpoint_dir`; a restarted job resumes from `restart_from`.
    checkpoint_every: int | None = None
    checkpoint_dir: str | None = None
    restart_from: str | None = None
    # `splitrun --metrics-dir DIR`: TensorBoard scalars of each step in DIR/<process>/.
    metrics_dir: str | None = None

    @classmethod
    def from_environment(cls, env: ProcessEnvironment) -> JobSettings:
        def given(value: float | None, default: float) -> float:
            return default if value is None else value
        return cls(recv_timeout_s=given(env.recv_timeout_s, cls.recv_timeout_s),
                   idle_timeout_s=given(env.idle_timeout_s, cls.idle_timeout_s),
                   heartbeat_timeout_s=given(env.heartbeat_timeout_s, cls.heartbeat_timeout_s),
                   checkpoint_every=env.checkpoint_every, checkpoint_dir=env.checkpoint_dir,
                   restart_from=env.restart_from, metrics_dir=env.metrics_dir)
