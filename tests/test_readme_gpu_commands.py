"""The README's model-parallel GPU commands keep each GPU's load within the layout known to fit
a 40 GB A100: the `mp` model (embed 1024) with tp 4 and 16 samples of 4050 tokens per GPU
(NERSC's tutorial measured ~33 GB for it; tests/gpu/test_gpu_memory.py measures ours on a GPU
node). One GPU holds local batch x tokens per cp rank / tp of the activations; every
`submit_pm_mp.sh` command in README.md, site/README.md and docs/*.md must stay at or below that
reference.
`mp` on one node (dp 1: all 64 samples on every GPU) is four times over it.
The GPU self-test's sbatch line is the same wherever the docs give it.
"""

from __future__ import annotations

import re
import shlex

import pytest
from helpers import CONFIG_FILE, REPO

from utils.config import read_config

GPUS_PER_NODE = 4          # submit_pm_mp.sh: 4 tasks per node (Perlmutter)
REFERENCE_LOAD = 16 * 4050 / 4  # samples x tokens / tp of the layout that fits 40 GB


def mp_commands() -> list[tuple[str, str]]:
    found = []
    docs = ["README.md", "site/README.md",
            *(f"docs/{p.name}" for p in sorted((REPO / "docs").glob("*.md")))]
    for doc in docs:
        for line in (REPO / doc).read_text().splitlines():
            # a command in a code block (up to its comment), or quoted in text or a table row
            quoted = re.findall(r"`([^`]+)`", line)
            for text in quoted or [line.split("#", 1)[0]]:
                if "sbatch" in text and "submit_pm_mp.sh" in text and "--config=" in text:
                    found.append((doc, text.strip()))
    return found


def per_gpu_load(command: str) -> tuple[float, str]:
    words = shlex.split(command)
    nodes, flags = 1, {}
    for i, w in enumerate(words):
        if w in ("--nodes", "-N"):
            nodes = int(words[i + 1])
        elif w.startswith("--nodes="):
            nodes = int(w.split("=", 1)[1])
        elif w.startswith("--") and "=" in w:
            key, value = w[2:].split("=", 1)
            flags[key] = value
    p = read_config(CONFIG_FILE, flags["config"])
    tp = int(flags.get("tp", flags.get("row_parallel_size", p.tp)))
    cp = int(flags.get("cp", p.cp))
    # the AFNO's spatial mesh splits the tokens like cp does (each GPU holds its tile)
    mesh = int(flags.get("h_parallel_size", p.h_parallel_size)) * \
        int(flags.get("w_parallel_size", p.w_parallel_size))
    gpus = nodes * GPUS_PER_NODE
    dp = gpus // (tp * cp * mesh)
    local = p.global_batch_size / dp
    h, w = p.img_size
    tokens = (h // p.patch_size) * (w // p.patch_size) / (cp * mesh)
    note = (f"{gpus} GPUs = tp {tp} x cp {cp} x h*w {mesh} x dp {dp}, {local:g} samples x "
            f"{tokens:.0f} tokens per GPU, embed {p.embed_dim}")
    return local * tokens / tp, note


def test_the_readmes_have_model_parallel_gpu_commands():
    assert len(mp_commands()) >= 4


@pytest.mark.parametrize("doc, command", mp_commands())
def test_model_parallel_gpu_command_fits_the_measured_layout(doc, command):
    load, note = per_gpu_load(command)
    assert load <= REFERENCE_LOAD, f"{doc}: `{command}` puts {note} on a GPU: " \
        f"{load / REFERENCE_LOAD:.1f}x the layout known to fit 40 GB"


def test_the_old_one_node_graphs_command_is_what_this_catches():
    load, _ = per_gpu_load("sbatch --nodes 1 submit_pm_mp.sh --config=mp --tp=4")
    assert load == 4 * REFERENCE_LOAD
    assert re.search(r"--config=mp_bs16 --tp=4", (REPO / "README.md").read_text())


def test_every_self_test_sbatch_line_is_the_one_docs_gpu_self_test_explains():
    """The GPU self-test's sbatch line is one line wherever it is given: its single task
    gets the node's CPUs (`-c`), and its time limit is twice the suite's estimate."""
    docs = ["README.md", "site/README.md",
            *(f"docs/{p.name}" for p in sorted((REPO / "docs").glob("*.md")))]
    lines = {(doc, " ".join(line.split("#", 1)[0].split()))
             for doc in docs for line in (REPO / doc).read_text().splitlines()
             if line.strip().startswith("sbatch") and "make test-gpu" in line}
    assert {doc for doc, _ in lines} >= {"README.md", "docs/gpu_first_run.md",
                                         "docs/gpu_self_test.md"}
    assert len({line for _, line in lines}) == 1, "\n".join(sorted(map(str, lines)))
    words = shlex.split(next(iter(lines))[1])
    srun = shlex.split(words[words.index("--wrap") + 1])
    assert "-c" in srun or any(w.startswith("--cpus-per-task") for w in srun), srun
    estimate = re.search(r"\*\*the whole self-test, one node\*\* \| \d+ \| \*\*~(\d+) min\*\*",
                         (REPO / "docs/gpu_self_test.md").read_text())
    assert estimate, "docs/gpu_self_test.md states no estimate for the whole self-test"
    assert int(words[words.index("-t") + 1]) >= 2 * int(estimate[1])
