"""`python -m splitrun`, and splitrun's global options accepted before or after
the subcommand."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cluster import child_env

from splitrun.launcher.cli import parse_args


@pytest.mark.parametrize("argv, level, log_dir", [
    # By default the progress, results and warnings; -v the lifecycle too, -vv debug.
    (["launch", "train.py"], "WARNING", None),
    (["-v", "launch", "train.py"], "INFO", None),
    (["launch", "-vv", "train.py"], "DEBUG", None),
    (["--log-level", "DEBUG", "--log-dir", "a", "launch", "train.py"], "DEBUG", "a"),
    (["launch", "--log-level", "WARNING", "--log-dir", "b", "train.py"], "WARNING", "b"),
    # Given in both places, the later one wins; --log-level wins over -v.
    (["--log-level", "DEBUG", "plan", "--log-level", "ERROR", "train.py"], "ERROR", None),
    (["-v", "launch", "--log-level", "ERROR", "train.py"], "ERROR", None),
    (["--log-dir", "a", "join", "train.py"], "WARNING", "a"),
])
def test_global_options_before_or_after_the_subcommand(argv, level, log_dir):
    args = parse_args(argv)
    assert (args.log_level, args.log_dir, args.metrics_dir) == (level, log_dir, None)


def test_options_after_the_script_belong_to_the_script():
    args = parse_args(["launch", "--workers", "2", "train.py", "--log-level", "x", "-v"])
    assert args.log_level == "WARNING" and args.script_args == ["--log-level", "x", "-v"]


def test_python_m_splitrun_is_the_splitrun_command(tmp_path):
    done = subprocess.run([sys.executable, "-m", "splitrun", "launch", "--help"],
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: splitrun launch" in done.stdout and "--metrics-dir" in done.stdout
    done = subprocess.run([sys.executable, "-m", "splitrun", "launch", "--workers", "0",
                           "x.py"], cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "need --workers >= 1" in done.stderr


@pytest.mark.parametrize("argv, message", [
    (["join", "x.py"], "join needs --scheduler HOST:PORT, or to run under srun or torchrun"),
    (["join", "--scheduler", "127.0.0.1:1", "--workers", "2", "x.py"],
     "--workers/--servers assign roles under srun or torchrun"),
    (["--log-dir", "logs", "join", "x.py"], "--log-dir is for splitrun launch"),
])
def test_join_refuses_what_it_cannot_do(tmp_path, argv, message):
    env = child_env({"SPLITRUN_TOKEN": "t"})
    for variable in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SPLITRUN_SCHEDULER"):
        env.pop(variable, None)
    done = subprocess.run([sys.executable, "-m", "splitrun", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
