"""The commands of the README's tutorial, read from the README itself: every line of the
`bash` blocks of its Quickstart and of "The tutorial, step by step", in order, each with its
step, its comment, and whether a CPU-only machine can run it (and why not, if not).

    python -m tools.readme_commands          # the list, as tools.tutorial_walk would run it

tools/tutorial_walk.py runs them; tests/test_tutorial_walk.py checks that what it runs is
exactly this list, so the walk and the page cannot drift apart.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SECTIONS = ("Quickstart", "The tutorial, step by step")  # the README's level-2 headings
COMMENT = re.compile(r"\s+#(?:\s|$)")  # a shell comment after a command
FRESH = re.compile(r"in a\s+fresh\s+`([^`]+)`")  # "Run them ... in a fresh `logs/...`"
TIME = re.compile(r"~\s*(?:\d+(?:\.\d+)?-)?(\d+(?:\.\d+)?)\s*(s|min|h)\b")  # "~2 min", "~6-9 min"
UNIT_SECONDS = {"s": 1, "min": 60, "h": 3600}


@dataclass
class Command:
    """One command line of a README block."""

    step: str  # "quickstart", "1", ..., "12"
    line: int  # 1-based line number in the README
    text: str  # the command, as written (without its comment)
    comment: str = ""  # the comment after it, and comment-only lines under it
    fresh_dir: str | None = None  # the README asks for this directory fresh before the block
    skip: str | None = None  # why a CPU-only machine does not run it (None: it runs)
    notes: list[str] = field(default_factory=list)

    @property
    def stated_seconds(self) -> float | None:
        """The time the README states next to the command ("~2 min"; of "~6-9 min" the
        upper bound), in seconds."""
        m = TIME.search(self.comment)
        return float(m.group(1)) * UNIT_SECONDS[m.group(2)] if m else None


def step_of(heading: str) -> str:
    """'### 8. Tensor parallelism' -> '8'; '## Quickstart' -> 'quickstart'."""
    m = re.match(r"#+\s+(\d+)\.", heading)
    return m.group(1) if m else heading.lstrip("#").strip().lower()


def blocks(readme: str) -> Iterator[tuple[str, str | None, list[tuple[int, str]]]]:
    """(step, fresh directory asked for, [(line number, line)]) of every `bash` block in
    the README's tutorial sections."""
    section = step = ""
    block: list[tuple[int, str]] | None = None
    paragraph: list[str] = []  # the prose since the last block (for "in a fresh `dir`")
    for number, line in enumerate(readme.splitlines(), start=1):
        if block is not None:
            if line.strip() == "```":
                found = FRESH.search(" ".join(paragraph))
                yield step, (found.group(1) if found else None), block
                block, paragraph = None, []
            else:
                block.append((number, line))
        elif line.strip() == "```bash" and section in SECTIONS:
            block = []
        else:
            if line.startswith(("## ", "### ")):
                step = step_of(line)
                section = line[3:].strip() if line.startswith("## ") else section
            paragraph.append(line)


def read_commands(readme: str) -> list[Command]:
    """Every command line of the `bash` blocks in the README's tutorial sections, in order;
    a comment-only line is part of the comment of the command above it."""
    commands: list[Command] = []
    for step, fresh, lines in blocks(readme):
        first = len(commands)
        for number, line in lines:
            stripped = line.strip()
            if stripped.startswith("#") and len(commands) > first:
                above = commands[-1]
                above.comment = f"{above.comment} {stripped.lstrip('#').strip()}".strip()
            elif stripped and not stripped.startswith("#"):
                text, comment = (COMMENT.split(line, maxsplit=1) + [""])[:2]
                commands.append(Command(step, number, text.strip(), comment.strip(),
                                        fresh if len(commands) == first else None))
    for command in commands:
        command.skip = why_skipped(command)
    return commands


def why_skipped(command: Command) -> str | None:
    """Why a CPU-only machine does not run `command`; None if it does."""
    text = command.text
    words = text.split()
    if text.startswith("git clone"):
        return "the walk runs in a fresh copy of this checkout"
    if "sbatch" in words or "srun" in words:
        return "needs a SLURM cluster"
    if "mpirun" in words and shutil.which("mpirun") is None:
        return "Open MPI is not installed (no mpirun on PATH)"
    if words[:2] == ["make", "test"]:
        return "the whole test suite, not a tutorial step: run it on its own"
    config = re.search(r"--config[= ](\S+)", text)
    if config and not config.group(1).startswith("cpu_"):
        return f"full-size config {config.group(1)}: a GPU run"
    return None


def tutorial_commands(repo: Path) -> list[Command]:
    return read_commands((repo / "README.md").read_text())


def main() -> None:
    for c in tutorial_commands(Path(__file__).resolve().parent.parent):
        status = f"skip ({c.skip})" if c.skip else "run"
        print(f"{c.step:>10}  README:{c.line:<4} {status:<12.60} {c.text}")


if __name__ == "__main__":
    main()
