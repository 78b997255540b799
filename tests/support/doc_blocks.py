"""The fenced code blocks of README.md, docs/*.md and CHANGELOG.md: what
tests/project/test_readme.py checks (every block says whether it runs) and
tests/e2e/test_readme_e2e.py runs."""

import pathlib
from dataclasses import dataclass

from cluster import REPO

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "CHANGELOG.md"]
RUNNABLE = {"python", "sh"}
NOT_RUN = {"text"}


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
