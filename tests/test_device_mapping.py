"""Which GPU a rank takes (distributed/comm.py): its local rank among the GPUs it sees, or
the one GPU of a task bound to its own; a node with more ranks than GPUs stops with one line
(before: local_rank % device_count put two ranks on one GPU, and NCCL failed later with a
multi-line "Duplicate GPU detected" error, which is now one line too)."""

from __future__ import annotations

import pytest
from helpers import one_line

from distributed.comm import cuda_index, shared_gpu_problem
from utils.errors import LaunchError

NCCL_DUPLICATE = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, invalid usage "
    "(run with NCCL_DEBUG=WARN for details), NCCL version 2.27.3\n"
    "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
    "Last error:\n"
    "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000")


def test_each_local_rank_takes_its_own_gpu():
    assert [cuda_index(r, 4, environ={}) for r in range(4)] == [0, 1, 2, 3]


def test_a_task_bound_to_its_own_gpus_takes_them():
    assert [cuda_index(r, 1, environ={}) for r in range(4)] == [0, 0, 0, 0]  # one each
    two_each = {"SLURM_GPUS_PER_TASK": "2"}  # 4 tasks x 2 GPUs: ranks 2, 3 see GPUs 4-7
    assert [cuda_index(r, 2, environ=two_each) for r in range(4)] == [0, 1, 0, 1]


def test_more_ranks_than_gpus_on_a_node_is_one_line():
    with pytest.raises(LaunchError) as e:
        cuda_index(4, 4, environ={"CUDA_VISIBLE_DEVICES": "3,2,1,0"})
    line = one_line(e)
    for words in ("local rank 4", "sees 4 GPUs", "CUDA_VISIBLE_DEVICES=3,2,1,0",
                  "--nproc_per_node", "--ntasks-per-node", "--gpus-per-task=1"):
        assert words in line, (words, line)
    assert not e.value.every_rank  # ranks 0-3 have their GPUs: the first to fail reports


def test_torchrun_with_more_ranks_per_node_than_gpus_stops_every_rank_with_one_line():
    """torchrun gives all its processes the node's GPUs, so every rank, rank 0 included,
    knows; rank 0 alone prints (also when each sees one GPU: 2 ranks, 1 GPU)."""
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"}
    for rank in (0, 1):
        with pytest.raises(LaunchError) as e:
            cuda_index(rank, 1, environ=torchrun)
        assert e.value.every_rank and "torchrun starts 2 ranks per node, which see 1 GPU " \
            "(CUDA_VISIBLE_DEVICES=unset)" in one_line(e)
    assert cuda_index(1, 2, environ=torchrun) == 1
    assert cuda_index(1, 1, environ={"LOCAL_WORLD_SIZE": "2"}) == 0  # not torchrun: bound


def test_ncccls_duplicate_gpu_error_becomes_one_line():
    line = shared_gpu_problem(NCCL_DUPLICATE)
    assert line is not None and "\n" not in line
    assert "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000" in line
    assert "--nproc_per_node" in line
    assert shared_gpu_problem("NCCL error: unhandled system error\nsocket closed") is None
