"""The gpu-check's one report: a markdown page to paste into an issue, and the same numbers as
JSON beside it. Every check, measurement and ladder row is a `Line`; `run_line` runs one and
turns what can go wrong into the line's status instead of stopping the others:

    ok     it ran, and what it proves held (its number says how closely)
    FAIL   it ran, and what it proves did not hold, or it raised (the reason, one line;
           the traceback goes to gpu-check.log beside the report)
    skip   it cannot run here: no GPU, a part missing, the GPU too small (the reason, and
           what to do), or the time budget spent
    info   a measurement without a pass mark (the environment, the ladder, memory parts)
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATUSES = ("ok", "FAIL", "skip", "info")


class Skip(Exception):  # noqa: N818 - a verdict, not an error
    """Raised by a check that cannot run here; its message is the reason."""


@dataclass
class Line:
    """One line of the report."""

    section: str
    name: str
    status: str
    number: str = ""
    detail: str = ""  # FAIL: why; skip: why and what to do; else a note
    seconds: float = 0.0
    estimate_s: float = 0.0  # what the plan allowed it (docs/gpu_first_run.md)
    data: dict[str, Any] = field(default_factory=dict)  # the raw numbers, for the JSON

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status


@dataclass
class Outcome:
    """What a check function returns: its status (ok or FAIL), number, note and data."""

    ok: bool
    number: str
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def run_line(section: str, name: str, fn: Callable[[], Outcome | Line], estimate_s: float,
             log: Path | None = None) -> Line:
    """`fn()` as a report line, timed; a Skip, a GPU out of memory, or any error becomes
    the line's status (the error's traceback is appended to `log`)."""
    start = time.perf_counter()
    try:
        got = fn()
    except Skip as e:
        return Line(section, name, "skip", detail=str(e), seconds=time.perf_counter() - start,
                    estimate_s=estimate_s)
    except Exception as e:  # noqa: BLE001 - one check's failure is a line, not the end
        out_of_memory = "out of memory" in str(e).lower()
        if out_of_memory:
            free_gpu_memory()
        if log is not None:
            with open(log, "a") as f:
                f.write(f"--- {section}: {name}\n{traceback.format_exc()}\n")
        status, why = ("skip", f"the GPU is too small for this check ({one_line(e)})") \
            if out_of_memory else ("FAIL", one_line(e))
        return Line(section, name, status, detail=why, seconds=time.perf_counter() - start,
                    estimate_s=estimate_s)
    seconds = time.perf_counter() - start
    if isinstance(got, Line):
        got.seconds, got.estimate_s = seconds, estimate_s
        return got
    return Line(section, name, "ok" if got.ok else "FAIL", got.number, got.detail, seconds,
                estimate_s, got.data)


def free_gpu_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- writing

def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def section_table(lines: list[Line], section: str) -> list[str]:
    rows = [line for line in lines if line.section == section]
    if not rows:
        return []
    out = ["| check | result | number | time (estimate) | note |",
           "| --- | --- | --- | ---: | --- |"]
    for r in rows:
        mark = {"ok": "ok", "FAIL": "**FAIL**", "skip": "skip", "info": ""}[r.status]
        took = f"{r.seconds:.0f} s ({r.estimate_s:.0f} s)" if r.estimate_s or r.seconds >= 1 \
            else ""
        out.append(f"| {cell(r.name)} | {mark} | {cell(r.number)} | {took} "
                   f"| {cell(r.detail)} |")
    return out


def markdown(title: str, header: list[str], lines: list[Line],
             sections: dict[str, str], extra: dict[str, list[str]]) -> str:
    """The report: `header` lines, then per section its title, its lines as a table and
    `extra` markdown after it (the memory parts, the ladder beside the tutorial's numbers)."""
    failed = [line for line in lines if line.status == "FAIL"]
    skipped = [line for line in lines if line.status == "skip"]
    verdict = (f"**{len(failed)} failed**: " + ", ".join(f.name for f in failed)
               if failed else "every check that ran passed")
    total = sum(line.seconds for line in lines)
    out = [f"# {title}", "", *header, "",
           f"Result: {verdict}; {len(skipped)} skipped; {total / 60:.1f} min of checks.", ""]
    for key, heading in sections.items():
        table = section_table(lines, key)
        if not table and not extra.get(key):
            continue
        out += [f"## {heading}", ""] + ([*table, ""] if table else [])
        if extra.get(key):
            out += [*extra[key], ""]
    return "\n".join(out).rstrip() + "\n"


def write(out_dir: Path, title: str, header: list[str], lines: list[Line],
          sections: dict[str, str], extra: dict[str, list[str]],
          facts: dict[str, Any]) -> tuple[Path, Path]:
    """report.md and report.json in `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / "report.md", out_dir / "report.json"
    md.write_text(markdown(title, header, lines, sections, extra))
    js.write_text(json.dumps({"title": title, "facts": facts,
                              "lines": [asdict(line) for line in lines]}, indent=1,
                             default=str))
    return md, js
