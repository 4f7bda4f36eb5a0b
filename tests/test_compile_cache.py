"""torch.compile is decided in one place (training/compiling.py) and its cost is shown and
paid once: a run logs its time to the first step and its compile time (and puts both in
TensorBoard); Inductor's caches live under the log root, one folder per node (its host
name), so a second job of the same config on that node finds every graph there; validation
compiles nothing."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest
from helpers import REPO, TINY_ITERS_PER_EPOCH, assert_completed

from training.compiling import (
    CACHE_ENV,
    CACHE_SUBDIR,
    cache_folder,
    node_name,
    use_compile_cache,
)

FIRST_STEP = re.compile(r"First step done ([\d.]+) s after the process started; torch\.compile "
                        r"([\d.]+) s for (\d+) graphs \(compile cache (.+): (\d+) hits, "
                        r"(\d+) misses\)")
WHOLE_RUN = re.compile(r"Whole run: torch\.compile ([\d.]+) s for (\d+) graphs \(compile cache "
                       r".+: (\d+) hits, (\d+) misses\)")


def compile_lines(stdout: str) -> tuple[re.Match, re.Match]:
    first, whole = FIRST_STEP.search(stdout), WHOLE_RUN.search(stdout)
    assert first and whole, stdout[-3000:]
    return first, whole


def startup_scalars(log_dir: Path) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = log_dir.rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag)[0].value for tag in acc.Tags()["scalars"]
            if tag.startswith("Startup/")}


@pytest.mark.e2e
def test_a_second_job_of_the_same_config_compiles_from_the_cache_under_the_log_root(
        run_train, tmp_path):
    """Jobs of two data-parallel ranks (DDP), which share the cache: the first compiles and
    fills it, the second finds every graph there."""
    logs = tmp_path / "logs"
    # Two epochs: validation runs before step 1 and after each epoch. "" = not set by the
    # user (a developer's own TORCHINDUCTOR_CACHE_DIR must not hide the default).
    args = ["--config=tiny", f"--num_iters={2 * TINY_ITERS_PER_EPOCH}", "--enable_jit"]
    env = {CACHE_ENV: "", "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no compile worker pool
    cold = run_train("train.py", args, env_extra=env, log_dir=logs, timeout=600, nproc=2)
    assert_completed(cold, 2 * TINY_ITERS_PER_EPOCH, epochs=2)
    first, whole = compile_lines(cold.stdout)
    assert first.group(4) == str(logs / CACHE_SUBDIR / cache_folder())  # this node's
    assert int(first.group(5)) == 0 and int(first.group(6)) > 0  # compiled from scratch
    assert any((logs / CACHE_SUBDIR).rglob("*")), "nothing was written to the cache"
    # Validation, before step 1 and after each epoch, runs the model eagerly: no graph is
    # compiled after the first step, none for evaluation before it (those are counted in
    # the first line: the model's training graph and the loss).
    assert whole.group(2) == first.group(3), (first.group(0), whole.group(0))
    assert float(whole.group(1)) == pytest.approx(float(first.group(2)), abs=0.05)
    scalars = startup_scalars(logs)
    assert scalars["Startup/time to first step [s]"] == pytest.approx(float(first.group(1)),
                                                                     abs=0.05)
    assert scalars["Startup/torch.compile [s]"] == pytest.approx(float(first.group(2)), abs=0.05)
    assert float(first.group(1)) > float(first.group(2)) > 0

    warm = run_train("train.py", args, env_extra=env, log_dir=logs, timeout=600, nproc=2)
    assert_completed(warm, 2 * TINY_ITERS_PER_EPOCH)
    first, whole = compile_lines(warm.stdout)
    assert first.group(4) == str(logs / CACHE_SUBDIR / cache_folder())
    hits, misses = int(first.group(5)), int(first.group(6))
    assert misses == 0 and hits > 0, first.group(0)  # every graph came from the cache
    assert whole.group(2) == first.group(3)


def test_a_compile_cache_chosen_by_the_user_or_the_site_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "site_cache"))
    assert use_compile_cache(str(tmp_path / "logs")) == str(tmp_path / "site_cache")
    assert os.environ[CACHE_ENV] == str(tmp_path / "site_cache")
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    expected = str(tmp_path / "logs" / CACHE_SUBDIR / node_name())  # one per node
    assert use_compile_cache(str(tmp_path / "logs")) == expected
    assert os.environ[CACHE_ENV] == expected  # where Inductor looks, set before it compiles
    monkeypatch.chdir(tmp_path)  # a relative log root (the configs' `logs`) made absolute
    monkeypatch.delenv(CACHE_ENV)
    assert use_compile_cache("logs") == expected


def test_each_node_keeps_its_own_compile_cache_under_the_log_root(tmp_path, monkeypatch):
    """Not one folder for all nodes: Inductor's file locks are slow or unreliable across the
    nodes of a parallel file system. A node's short host name names its folder."""
    import socket

    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    dirs = []
    for host in ("nid001234.chn.example.org", "nid001235"):
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        dirs.append(use_compile_cache(str(tmp_path / "logs")))
        monkeypatch.delenv(CACHE_ENV)
    assert dirs == [str(tmp_path / "logs" / CACHE_SUBDIR / "nid001234"),
                    str(tmp_path / "logs" / CACHE_SUBDIR / "nid001235")]


def test_a_capped_vector_isa_keeps_its_own_compile_cache(tmp_path, monkeypatch):
    """Inductor generates kernels for the vector width ATEN_CPU_CAPABILITY caps it to, and its
    cache key leaves the cap out: walks of the tutorial under different caps (`make tutorial
    CPU_CLASS=...`) must not find each other's kernels."""
    dirs = []
    for cap in ("", "avx2", "avx512"):
        monkeypatch.delenv(CACHE_ENV, raising=False)
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
        dirs.append(use_compile_cache(str(tmp_path / "logs")))
    root = tmp_path / "logs" / CACHE_SUBDIR
    assert dirs == [str(root / node_name()), str(root / f"{node_name()}-avx2"),
                    str(root / f"{node_name()}-avx512")]


def test_only_training_compiling_calls_torch_compile():
    """The project's code (benchmarks included: they time what training compiles) reaches
    torch.compile through training/compiling.py only."""
    callers = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[0] in ("tests", ".venv", "datasets") or rel.parts[0].startswith("."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.compile":
                callers.append(f"{rel}:{node.lineno}")
    assert [c.split(":")[0] for c in callers] == ["training/compiling.py"], callers
