"""`make tutorial` (tools/tutorial_walk.py) runs the README's own commands: each one it runs
is a line of the README's tutorial, as written, in the README's order; every command line
there is either run or skipped for a stated reason (a cluster, a GPU, Open MPI missing); and
each command run has something the README says to look at checked, not only its exit code."""

from __future__ import annotations

import re
import shutil

import pytest
from helpers import REPO

from tools import tutorial_checks, tutorial_walk
from tools.readme_commands import read_commands, tutorial_commands
from utils.hardware import CAP_VARS

README = (REPO / "README.md").read_text()
LINES = README.splitlines()


def tutorial_text() -> str:
    """The README from its Quickstart to the end of step 12."""
    return README.split("\n## Quickstart")[1].split("\n## Before the first GPU run")[0]


def test_each_command_the_walk_runs_is_a_readme_line_as_written_in_order():
    commands = tutorial_commands(REPO)
    assert [c.line for c in commands] == sorted({c.line for c in commands})
    for c in commands:
        assert LINES[c.line - 1].strip().startswith(c.text), (c.line, c.text)
        rest = LINES[c.line - 1].strip()[len(c.text):]
        assert rest == "" or rest.lstrip().startswith("#"), (c.line, rest)


def test_every_command_line_of_the_tutorial_is_run_or_skipped_for_a_reason():
    blocks = re.findall(r"```bash\n(.*?)```", tutorial_text(), flags=re.DOTALL)
    written = [line.strip() for block in blocks for line in block.splitlines()
               if line.strip() and not line.strip().startswith("#")]
    commands = tutorial_commands(REPO)
    assert [re.split(r"\s+#", w)[0].strip() for w in written] == [c.text for c in commands]
    reasons = ("needs a SLURM cluster", "a GPU run", "Open MPI is not installed",
               "the walk runs in a fresh copy", "the whole test suite")
    for c in commands:
        assert c.skip is None or any(r in c.skip for r in reasons), (c.text, c.skip)


def test_no_cpu_training_or_evaluation_command_is_skipped():
    for c in tutorial_commands(REPO):
        if re.search(r"(python|torchrun) .*--config[= ]cpu_", c.text) or \
                c.text.startswith(("make train", "make evaluate")):
            assert c.skip is None or ("mpirun" in c.text and shutil.which("mpirun") is None), \
                c.text


def test_every_command_run_has_what_the_readme_says_to_look_at_checked():
    for c in tutorial_commands(REPO):
        if c.skip or c.text.startswith(("source ", "tensorboard ")):
            continue  # activation (the walk's shell has it), a server (its page is asked)
        assert tutorial_checks.looks(c), f"nothing to look at is checked for: {c.text}"


def test_make_beats_persistence_and_the_ladder_names_each_run():
    commands = {c.text: c for c in tutorial_commands(REPO)}
    out = "RMSE(u10m) model=1.2000 m/s, persistence=1.0666 m/s\nFinished 8 iterations\n"
    verdicts = [check(out, REPO) for check in tutorial_checks.looks(commands["make train"])]
    assert not all(ok for ok, _ in verdicts), verdicts  # above persistence: not passed
    ladder = [c for c in tutorial_commands(REPO) if c.fresh_dir]
    assert ladder and ladder[0].fresh_dir == "logs/cpu_short/1CPU"


def test_the_walk_runs_the_commands_exactly_as_written(tmp_path):
    """On a README of harmless commands: what runs is each line as written, in order, in
    the copy; a skipped one does not run; a failing one is reported, not hidden."""
    readme = "\n".join([
        "## Quickstart", "```bash", "echo one > one.txt   # writes one.txt",
        "sbatch job.sh", "```", "## The tutorial, step by step", "### 1. First",
        "Run it in a fresh `out`:", "```bash", "mkdir -p out && echo two > out/two.txt",
        "cat missing.txt", "```", "## Elsewhere", "```bash", "echo never", "```", ""])
    commands = read_commands(readme)
    assert [c.text for c in commands] == ["echo one > one.txt", "sbatch job.sh",
                                          "mkdir -p out && echo two > out/two.txt",
                                          "cat missing.txt"]
    (tmp_path / "out").mkdir()
    results = tutorial_walk.walk(tmp_path, commands, timeout=30)
    assert [r.status for r in results] == ["0", "skipped", "0", "1"]
    assert (tmp_path / "one.txt").read_text() == "one\n"
    assert (tmp_path / "out" / "two.txt").exists()
    assert (tmp_path / "out-before-step-1").is_dir()  # the README asked for a fresh `out`
    assert not results[3].ok and "cat missing.txt" in tutorial_walk.table(results)


def test_make_tutorial_runs_the_walk_and_make_test_does_not():
    makefile = (REPO / "Makefile").read_text()
    target = re.search(r"^tutorial:.*\n\t(.*)$", makefile, re.MULTILINE)
    assert target and "-m tools.tutorial_walk" in target.group(1)
    test = re.search(r"^test:.*\n\t(.*)$", makefile, re.MULTILINE)
    assert test and "tutorial" not in test.group(1)


@pytest.mark.parametrize("comment, seconds", [("~2 min; the config's 1200 take ~2 h", 120),
                                              ("CPU: the newest run, ~10 s", 10),
                                              ("the long baseline (~6-9 min)", 540), ("", None)])
def test_the_time_a_command_states_is_read_from_its_comment(comment, seconds):
    c = read_commands(f"## Quickstart\n```bash\nmake x   # {comment}\n```\n")[0]
    assert c.stated_seconds == seconds


def test_the_report_names_the_cpu_its_class_and_the_torch_build():
    import torch

    name, line = tutorial_walk.machine()
    assert torch.__version__ in line and f"CPU class {name}: " in line, line
    assert torch.backends.cpu.get_cpu_capability() in line, line
    assert ("native bf16" in line) != ("bf16 emulated" in line), line


def test_a_class_walk_runs_every_command_under_that_class_caps(tmp_path, monkeypatch):
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX512_CORE")  # a cap of the caller's: replaced
    env = tutorial_walk.environment(tmp_path, "avx2")
    assert {k: env.get(k) for k in CAP_VARS} == {"ATEN_CPU_CAPABILITY": "avx2",
                                                 "ONEDNN_MAX_CPU_ISA": "AVX2",
                                                 "DNNL_MAX_CPU_ISA": None}
    readme = ("## Quickstart\n```bash\necho $ATEN_CPU_CAPABILITY $ONEDNN_MAX_CPU_ISA > caps.txt\n"
              "```\n")
    results = tutorial_walk.walk(tmp_path, read_commands(readme), timeout=30, cpu_class="avx2")
    assert results[0].status == "0"
    assert (tmp_path / "caps.txt").read_text() == "avx2 AVX2\n"


def test_a_class_this_cpu_cannot_reach_is_refused_in_one_line(tmp_path, capsys):
    """A cap only takes instructions away: asking for a class above this CPU's ends the walk
    before it copies anything, saying which class the caps gave instead."""
    for name in ("amx", "avx512_bf16", "avx512"):
        if tutorial_walk.machine(tutorial_walk.environment(REPO, name))[0] != name:
            break
    else:
        pytest.skip("this CPU reaches every class")
    workdir = tmp_path / "walk"
    assert tutorial_walk.main(["--cpu_class", name, "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --cpu_class {name}: under its caps this CPU computes as "
                          "class ") and err.count("\n") == 1, err
    assert not workdir.exists()


def test_the_walk_report_is_a_docs_section_headed_by_its_class():
    commands = read_commands("## Quickstart\n```bash\nmake train   # ~2 min\n```\n")
    text = tutorial_walk.report(("avx2", "AMD EPYC, 2 CPUs; CPU class avx2: ..."),
                                [tutorial_walk.Result(commands[0], "0", 100.0, 190.0)], 101.0,
                                ("2.0", "2.1"))
    assert text.startswith("### CPU class avx2\n\nAMD EPYC, 2 CPUs; CPU class avx2: ...\n\n"
                           "| step | command | exit | wall | CPU | README says |"), text
    assert "1 commands run, 0 skipped, 0 failed" in text and "(3.2 min of CPU time)" in text


def test_no_cpu_command_of_the_tutorial_trains_in_a_precision_it_may_emulate():
    """Step 5 stays short on every CPU: its CPU command times bf16 against fp32 side by
    side within a budget, and no CPU training run asks for bf16 or fp16 outright (on a CPU
    that emulates it, 64 iterations took 13 min); `auto` is fp32 there."""
    commands = [c for c in tutorial_commands(REPO) if not c.skip]
    step5 = [c.text for c in commands if c.step == "5"]
    assert len(step5) == 1 and "bench.bench_step" in step5[0], step5
    assert "--amp_modes none bf16" in step5[0]
    budget = re.search(r"--budget_s (\d+)", step5[0])
    assert budget and int(budget.group(1)) <= 120, step5
    for c in commands:
        assert not re.search(r"--amp_mode[= ](bf16|fp16)\b", c.text), c.text
