"""train_mp_graphs.py's CUDA-graph step, the parts that need no GPU: the warm-up before a
DDP capture, and the graph released on every ending before the process groups end (a
captured NCCL collective keeps its communicator alive: NCCL >= 2.26 waits for the graph).
The capture itself runs in the GPU self-test (tests/gpu/test_gpu_parallel.py)."""

from __future__ import annotations

import logging
import os
from types import ModuleType

import pytest
import torch


@pytest.fixture(scope="module")
def graphs() -> ModuleType:
    """The script as a module; importing it (train.py) must not change this session's
    environment (OMP_WAIT_POLICY)."""
    before = os.environ.get("OMP_WAIT_POLICY")
    import train_mp_graphs

    if before is None:
        os.environ.pop("OMP_WAIT_POLICY", None)
    return train_mp_graphs


def test_a_ddp_capture_gets_at_least_11_warm_up_steps_and_the_log_says_so(graphs, caplog):
    with caplog.at_level(logging.WARNING, logger="train_mp_graphs"):
        assert graphs.warmup_steps(3, ddp=True) == graphs.DDP_WARMUP == 11
    assert "--graph_warmup 3 raised to 11" in caplog.text
    caplog.clear()
    assert graphs.warmup_steps(3, ddp=False) == 3  # dp = 1: no DDP, any warm-up
    assert graphs.warmup_steps(20, ddp=True) == 20
    assert caplog.text == ""


class FakeGraph:
    resets = 0

    def reset(self) -> None:
        self.resets += 1


@pytest.mark.parametrize("ending", ["returns", "bug", "exit"])
def test_the_graph_is_released_however_the_run_ends(graphs, monkeypatch, ending):
    """main() with a GPU: whatever train_mp.main does after capture, the graph is reset
    once before main() hands over to run_main (which then shuts the process groups down)."""
    graph, steps = FakeGraph(), []

    def train(argv, step):
        step.graph = graph  # what prepare() leaves behind
        steps.append(step)
        if ending == "bug":
            raise RuntimeError("a bug in the loop")
        if ending == "exit":
            raise SystemExit(3)  # preempted

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(graphs.train_mp, "main", train)
    if ending == "returns":
        graphs.main(["--config=tiny", "--graph_warmup=2"])
    else:
        with pytest.raises((RuntimeError, SystemExit)):
            graphs.main(["--config=tiny"])
    assert graph.resets == 1 and steps[0].graph is None
    steps[0].release()  # a second release does nothing
    assert graph.resets == 1
    assert isinstance(steps[0], graphs.GraphedStep)


@pytest.mark.parametrize("argv", [["--graph_warmup", "many"], ["--graph_warmup=-1"],
                                  ["--config=tiny", "--graph_warmup"]])
def test_a_bad_graph_warmup_is_one_line_naming_the_flag(argv):
    from train_mp_graphs import split_graph_args
    from utils.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--graph_warmup '.*': expected .* an integer >= 0$"):
        split_graph_args(argv)
    assert split_graph_args(["--graph_warmup", "7", "--config=tiny"]) == (["--config=tiny"], 7)
