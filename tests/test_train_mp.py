"""Model parallelism end to end: train_mp.py with tp / cp is the same training as train.py.

Why the curves agree: the model parallel ViT initialises every parameter from (seed, name)
and keeps its shard (networks.blocks.init_weights), so every layout starts from train.py's
weights; with dp = 1 each rank reads the whole global batch, as train.py does. What differs is
where the additions of a matmul or an attention sum happen: split over ranks and combined by
an all-reduce / all-gather. In fp32 that changes the last bits (~1e-7 relative per step).

Tolerances (helpers.CPU_FP32, as in tests/test_ddp.py): the printed losses (6 decimals) agree
to 1e-5 relative, and after 16 Adam steps (lr 1e-3) the final parameters, gathered into full tensors
in the checkpoint, agree to 1e-5 absolute (measured: <= 3e-7 for tp 2, cp 2 and tp 2 x cp 2);
Adam's first and second moments agree to 1e-4 of each tensor's largest entry (measured
~1e-6), which also catches a gradient reduced over the wrong group (summed twice, or not at
all): Adam's update is scale invariant, its moments are not.

The runs are real processes (torchrun, gloo, 2 or 4 ranks); about a minute for the file.
"""

from __future__ import annotations

import re

import pytest
from helpers import (
    TINY_ITERS,
    assert_completed,
    assert_same_training,
    layout_of,
    run_distributed,
    run_script,
)

from utils.config import flag_parser

ITERS = TINY_ITERS
TIMEOUT = 240  # seconds per training subprocess
GRAPHS_MESSAGE = "CUDA graphs need a GPU"


def run(script: str, tiny_data, tmp_path_factory, *flags: str, nproc: int | None = None):
    return run_script(script, ["--config=tiny", f"--num_iters={ITERS}", *flags],
                      data_dir=tiny_data, log_dir=tmp_path_factory.mktemp("logs"), nproc=nproc,
                      timeout=TIMEOUT)


@pytest.fixture(scope="module")
def tp2(tiny_data, tmp_path_factory):
    return run("train_mp.py", tiny_data, tmp_path_factory, "--tp=2", nproc=2)


@pytest.fixture(scope="module")
def cp2(tiny_data, tmp_path_factory):
    return run("train_mp.py", tiny_data, tmp_path_factory, "--cp=2", nproc=2)


@pytest.fixture(scope="module")
def graphs(tiny_data, tmp_path_factory):
    """train_mp_graphs.py on this CPU, with the tutorial's spelling of --tp."""
    return run("train_mp_graphs.py", tiny_data, tmp_path_factory, "--row_parallel_size=2",
               nproc=2)


def local_parameter_count(params, tp: int, cp: int) -> int:
    """Parameters held by one rank of a tp x cp layout (runs on tp * cp processes)."""

    def count() -> int:
        from distributed import comm
        from networks.vit import vit_from_params

        comm.init(tp=tp, cp=cp)
        layers = layout_of(params.replace(tp=tp, cp=cp)).layers  # as train_mp.py decides
        model = vit_from_params(params, layers=layers)
        return sum(p.numel() for p in model.parameters())

    counts = run_distributed(count, tp * cp, timeout=120)
    assert len(set(counts)) == 1, counts
    return counts[0]


def logged_gb(run, pattern: str) -> float:
    m = re.search(pattern + r" ([0-9.]+) GB", run.stdout)
    assert m, f"no line matching {pattern!r}\n{run.stdout[-3000:]}"
    return float(m.group(1))


# ----------------------------------------------------------------- same curve as train.py
# `serial_reference` (conftest.py): train.py on one process, global batch 4, 16 iterations.

@pytest.mark.e2e
def test_tp2_trains_like_train_py(serial_reference, tp2):
    assert_completed(tp2, ITERS)
    assert_same_training(tp2, serial_reference, world_size=2)


@pytest.mark.e2e
def test_cp2_trains_like_train_py(serial_reference, cp2):
    assert_completed(cp2, ITERS)
    assert "Layout: DP = 1, TP = 1, CP = 2" in cp2.stdout
    assert_same_training(cp2, serial_reference, world_size=2)


@pytest.mark.e2e
def test_tp2_cp2_on_four_ranks_trains_like_train_py(serial_reference, tiny_data,
                                                    tmp_path_factory):
    both = run("train_mp.py", tiny_data, tmp_path_factory, "--tp=2", "--cp=2", nproc=4)
    assert_completed(both, ITERS)
    assert "Layout: DP = 1, TP = 2, CP = 2" in both.stdout
    assert_same_training(both, serial_reference, world_size=4)


# ----------------------------------------------------------------- what the log says

@pytest.mark.e2e
@pytest.mark.distributed
def test_tp2_log_shows_the_layout_parameters_per_rank_and_memory(tp2, tiny_params):
    assert_completed(tp2, ITERS)
    assert "Layout: DP = 1, TP = 2, CP = 1 (order tp-cp-h-w-ens-dp)" in tp2.stdout
    assert "world size 2 (env launcher), global batch 4, local batch 4" in tp2.stdout
    full = local_parameter_count(tiny_params, 1, 1)
    local = local_parameter_count(tiny_params, 2, 1)
    assert full / 2 < local < full  # sharded matmuls halve; norms, embeddings, head do not
    assert f"Parameters on this rank: {local / 1e6:.2f} M" in tp2.stdout
    setup = logged_gb(tp2, r"memory after model set-up \(scaffolding high-water mark\)")
    step2 = logged_gb(tp2, r"Memory of step 2 \(its own peak, reset once warm\):")
    peak = logged_gb(tp2, rf"Finished {ITERS} iterations; peak memory")
    assert 0 < setup <= peak and 0 < step2 <= peak  # CPU: the resident set's peaks
    # beside it, the memory planner's estimate of this rank's tensors (planning/memory.py),
    # traced in the run's own precision, for the eager step
    assert 0 < logged_gb(tp2, r"resident set; planner's estimate of the tensors") < step2
    assert re.search(r"planner's estimate of the tensors [\d.]+ GB \(eager step, (fp32|bf16);",
                     tp2.stdout), tp2.stdout[-2000:]


@pytest.mark.e2e
@pytest.mark.distributed
def test_cp_keeps_every_parameter_on_every_rank(cp2, tiny_params):
    assert_completed(cp2, ITERS)
    full = local_parameter_count(tiny_params, 1, 1)
    assert f"Parameters on this rank: {full / 1e6:.2f} M" in cp2.stdout


def test_row_parallel_size_is_the_tutorials_name_for_tp():
    parser = flag_parser("test", model_parallel=True)
    assert parser.parse_args(["--row_parallel_size", "2"]).tp == 2
    assert parser.parse_args(["--row_parallel_size=4"]).tp == 4
    assert parser.parse_args([]).tp is None  # the config's tp applies


# ----------------------------------------------------------------- train_mp_graphs.py on CPU

@pytest.mark.e2e
def test_graphs_script_says_it_needs_a_gpu_and_trains_eagerly(graphs):
    assert_completed(graphs, ITERS)
    # Once per job, in the run's log (rank 0's), not once per rank.
    assert graphs.output.count(GRAPHS_MESSAGE) == 1, graphs.output[-3000:]
    assert GRAPHS_MESSAGE in (graphs.exp_dir("tiny", world_size=2) / "out.log").read_text()
    assert "Layout: DP = 1, TP = 2, CP = 1" in graphs.stdout  # --row_parallel_size=2
    assert "Capturing" not in graphs.output


@pytest.mark.e2e
def test_graphs_script_on_cpu_gives_train_mp_py_curve(graphs, tp2):
    """Same step function, same processes: in practice bitwise equal; the shared tolerance
    keeps the test independent of that."""
    assert_completed(graphs, ITERS)
    assert_completed(tp2, ITERS)
    assert_same_training(graphs, tp2, world_size=2, ref_world_size=2)
