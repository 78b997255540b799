"""The README, docs/*.md and CHANGELOG.md: every ```python and ```sh block says
whether it runs (tests/e2e/test_readme_e2e.py runs them as written), every link
resolves, the benchmarks' plots are drawn from the kept runs, and the README
stays a page."""

import pathlib
import re
import subprocess
import sys

from cluster import JOB_TIMEOUT_S, REPO
from doc_blocks import BLOCKS, NOT_RUN, PAGES, README, RUNNABLE

# The issue asks for a README a newcomer reads in five minutes.
README_MAX_LINES = 250
# Every mode's example in the README runs.
README_MIN_RUNNABLE = 4


def test_every_block_says_whether_it_runs():
    unknown = [f"{b.id}: ```{b.language}" for b in BLOCKS
               if b.language not in RUNNABLE | NOT_RUN]
    assert not unknown, ("fence every code block as ```python or ```sh (run by "
                         "tests/e2e/test_readme_e2e.py) or ```text (not runnable "
                         "here):\n" + "\n".join(unknown))
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
