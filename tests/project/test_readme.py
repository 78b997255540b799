"""The README, docs/*.md and CHANGELOG.md: every ```python and ```sh block runs as
written, every link resolves, and the README stays a page.

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
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from cluster import JOB_TIMEOUT_S, REPO, Proc, child_env

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "CHANGELOG.md"]
RUNNABLE = {"python", "sh"}
NOT_RUN = {"text"}
LAUNCHED = re.compile(r"^# (\w+\.py); run it with: (splitrun launch .*\1)$")
# The issue asks for a README a newcomer reads in five minutes.
README_MAX_LINES = 250
# Every mode's example in the README runs.
README_MIN_RUNNABLE = 4


@dataclass(frozen=True)
class Block:
    page: pathlib.Path
    language: str
    line: int  # of the opening fence, 1-based
    text: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}-{self.language}"


def fenced_blocks(page: pathlib.Path) -> list[Block]:
    blocks, opened = [], None
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if not line.startswith("```"):
            if opened is not None:
                opened[2].append(line)
            continue
        if opened is None:
            opened = (line[3:].strip(), number, [])
        else:
            language, start, lines = opened
            blocks.append(Block(page, language, start, "\n".join(lines) + "\n"))
            opened = None
    assert opened is None, f"{page.relative_to(REPO)}:{opened[1]}: a code block is never closed"
    return blocks


BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]


def test_every_block_says_whether_it_runs():
    unknown = [f"{b.id}: ```{b.language}" for b in BLOCKS
               if b.language not in RUNNABLE | NOT_RUN]
    assert not unknown, ("fence every code block as ```python or ```sh (run by this "
                         "test) or ```text (not runnable here):\n" + "\n".join(unknown))
    in_readme = sum(b.language in RUNNABLE for b in BLOCKS if b.page == README)
    assert in_readme >= README_MIN_RUNNABLE, f"the README runs {in_readme} blocks"


def test_the_readme_reads_in_five_minutes():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail to "
        f"docs/ and link it")


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped
    (but '-' and '_'), spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_link_resolves():
    broken = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}: no such file")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
                broken.append(f"{page.relative_to(REPO)}: {target}: no heading "
                              f"#{fragment} in {linked.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_the_benchmark_plots_are_drawn_from_the_kept_runs(tmp_path):
    """bench/plots.py draws, from docs/bench-data/, every plot docs/benchmarks.md
    shows: a change to a benchmark's JSON that the plots no longer read fails here."""
    shown = set(re.findall(r"\]\(img/(bench-[\w-]+\.png)\)",
                           (REPO / "docs" / "benchmarks.md").read_text()))
    done = subprocess.run([sys.executable, REPO / "bench" / "plots.py", "--out", tmp_path],
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    drawn = {p.name for p in tmp_path.glob("*.png")}
    assert shown <= drawn, f"shown but not drawn: {sorted(shown - drawn)}"
    assert drawn <= shown, f"drawn but not shown in docs/benchmarks.md: {sorted(drawn - shown)}"


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


@pytest.mark.slow
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
