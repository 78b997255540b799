"""The README, docs/*.md and CHANGELOG.md: every ```python and ```sh block runs as
written (that each block says whether it runs, the links and the README's
length: tests/project/test_readme.py).

A python block runs as a script in a fresh folder; one whose first line says
`# NAME.py; run it with: splitrun launch ...` is written to NAME.py and started by
that command (a real launcher, real processes). A sh block runs in bash, in a
fresh folder that links the repository's examples/. Commands that cannot run
here (make targets, which include `make test` itself, and commands for two
machines) are fenced ```text. A block that uses `--device cuda` runs where CUDA is.
"""

import os
import pathlib
import re
import sys

import pytest
import torch
from cluster import JOB_TIMEOUT_S, REPO, Proc, child_env
from doc_blocks import BLOCKS, RUNNABLE

LAUNCHED = re.compile(r"^# (\w+\.py); run it with: (splitrun launch .*\1)$")


def _run(argv, folder: pathlib.Path, timeout_s: float) -> Proc:
    env = child_env()
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    proc = Proc(argv, env=env, cwd=folder)
    try:
        code = proc.wait(timeout_s)
    finally:
        proc.kill()
    assert code == 0, f"{' '.join(map(str, argv))} exited with {code}:\n{proc.output()}"
    return proc


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language in RUNNABLE],
                         ids=lambda b: b.id)
def test_block_runs_as_written(block, tmp_path):
    if "--device cuda" in block.text and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if block.language == "sh":
        (tmp_path / "examples").symlink_to(REPO / "examples")
        commands = len([line for line in block.text.splitlines() if line.strip()])
        _run(["bash", "-euo", "pipefail", "-c", block.text], tmp_path,
             JOB_TIMEOUT_S * commands)
        return
    first_line = block.text.splitlines()[0]
    launched = LAUNCHED.match(first_line)
    if launched is None:
        assert "Job.from_env()" not in block.text, (
            f"{block.id}: a block that joins a cluster starts with "
            f"'# NAME.py; run it with: splitrun launch ... NAME.py'")
        script = tmp_path / "snippet.py"
        script.write_text(block.text)
        _run([sys.executable, script], tmp_path, JOB_TIMEOUT_S)
        return
    name, command = launched.groups()
    (tmp_path / name).write_text(block.text)
    proc = _run(["bash", "-euo", "pipefail", "-c", command], tmp_path, JOB_TIMEOUT_S)
    assert re.search(r"all \d+ processes finished", proc.output()), proc.output()
