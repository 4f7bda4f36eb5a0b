"""Print the config reference (every key of utils.config_schema) as markdown tables.

    python -m tools.config_reference                  # print the tables
    python -m tools.config_reference --write FILE     # replace them in FILE, between
                                                      # the config-reference markers
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from utils.config_schema import GROUPS, Flag, expected

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.default
    if isinstance(value, bool):
        value = str(value).lower()  # YAML's spelling
    return f"`{value}`" if value != "" else '`""`'  # `` would be no code span at all


def _flag(field: Any, key: str) -> str:
    """The key's command-line flag and its aliases, from its `Flag` marker ('' if none);
    flags of the model-parallel scripts only, or of one script, are marked so."""
    flag = next((m for m in field.metadata if isinstance(m, Flag)), None)
    if flag is None:
        return ""
    names = ", ".join(f"`{name}`" for name in (f"--{key}", *flag.aliases))
    if flag.script:
        return f"{names} ({flag.script})"
    return f"{names} (model-parallel scripts)" if flag.model_parallel else names


def render() -> str:
    """One table per group of keys: key, type, default, flag, meaning."""
    out: list[str] = []
    for group in GROUPS:
        out += [f"**{group.__doc__}**", "",
                "| key | type | default | flag | meaning |", "|---|---|---|---|---|"]
        for key, field in group.model_fields.items():
            cells = [f"`{key}`", expected(key), _default(field), _flag(field, key),
                     field.description or ""]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def between_markers(text: str) -> str | None:
    """The part of `text` between the markers (stripped), None without them."""
    m = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), text, flags=re.S)
    return m.group(1).strip() if m else None


def write(path: Path) -> None:
    text = path.read_text()
    if between_markers(text) is None:
        raise SystemExit(f"error: {path} has no {START} ... {END} block")
    start, end = text.index(START) + len(START), text.index(END)
    path.write_text(text[:start] + "\n" + render().strip() + "\n" + text[end:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", type=Path, default=None, help="update the tables in this file")
    args = p.parse_args(argv)
    if args.write:
        write(args.write)
    else:
        sys.stdout.write(render())


if __name__ == "__main__":
    main()
