"""train_mp_graphs.py's CUDA-graph step, the parts that need no GPU: how many eager steps
warm up before capture (a schema key, `graph_warmup`), the check that the warm-up has
created what the graph reuses, and the graph released on every ending before the process
groups end (a captured NCCL collective keeps its communicator alive: NCCL >= 2.26 waits for
the graph). The capture itself runs in the GPU self-test (tests/gpu/test_gpu_parallel.py)."""

from __future__ import annotations

import logging
import os
from types import ModuleType

import pytest
import torch
from helpers import CONFIG_FILE, one_line

from utils.config import FlagError, load_config, read_config
from utils.errors import ConfigError


@pytest.fixture(scope="module")
def graphs() -> ModuleType:
    """The script as a module; importing it (train.py) must not change this session's
    environment (OMP_WAIT_POLICY)."""
    before = os.environ.get("OMP_WAIT_POLICY")
    import train_mp_graphs

    if before is None:
        os.environ.pop("OMP_WAIT_POLICY", None)
    return train_mp_graphs


def graph_config(*flags: str, script: str = "train_mp_graphs.py"):
    return load_config(["--yaml_config", str(CONFIG_FILE), "--config=tiny", *flags], "t",
                       model_parallel=True, script=script)


def test_a_ddp_capture_gets_at_least_11_warm_up_steps_and_the_log_says_so(graphs, caplog):
    with caplog.at_level(logging.WARNING, logger="train_mp_graphs"):
        assert graphs.warmup_steps(3, ddp=True) == graphs.DDP_WARMUP == 11
    assert "--graph_warmup 3 raised to 11" in caplog.text
    caplog.clear()
    assert graphs.warmup_steps(3, ddp=False) == 3  # dp = 1: no DDP, the schema's minimum
    assert graphs.warmup_steps(20, ddp=True) == 20
    assert caplog.text == ""


def test_graph_warmup_is_a_config_key_and_a_flag_of_the_graphs_script_alone():
    assert graph_config().graph_warmup == 20  # the schema's default, written once
    assert graph_config("--graph_warmup", "7").graph_warmup == 7
    assert graph_config("--graph_warmup", "7").flags == {"graph_warmup": 7}
    with pytest.raises(FlagError, match="unrecognized arguments: --graph_warmup"):
        graph_config("--graph_warmup", "7", script=None)  # train_mp.py has no such flag


@pytest.mark.parametrize("value", ["0", "2", "-1"])
def test_too_few_warm_up_steps_are_refused_with_one_line(value):
    """No (or too little) warm-up would leave the loss scale and Adam's state to be created
    inside the capture, where every replay resets them."""
    with pytest.raises(ConfigError) as e:
        graph_config("--graph_warmup", value)
    assert one_line(e) == f"bad value --graph_warmup {value}: expected int >= 3"
    with pytest.raises(FlagError, match="--graph_warmup: invalid int value: 'many'"):
        graph_config("--graph_warmup", "many")


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_capture_is_refused_until_warm_up_has_created_what_the_graph_reuses(graphs, amp):
    """The check before capture, on the CPU objects a run builds: an fp16 graph scales the
    loss with the scaler's scale tensor, a bf16 graph holds Adam's step; both must exist
    before capture. One eager step creates them."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=amp == "fp16")
    in_graph = not scaler.is_enabled()  # with loss scaling the optimizer steps eagerly
    missing = "the loss scale" if amp == "fp16" else "the optimizer state of 2 of 2 parameters"
    with pytest.raises(RuntimeError, match=f"warm-up has not created {missing}, which "
                                           "every replay would then reset"):
        graphs.check_ready_for_capture(scaler, optimizer, optimizer_in_graph=in_graph)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()  # one eager step
    scaler.step(optimizer)
    scaler.update()
    graphs.check_ready_for_capture(scaler, optimizer, optimizer_in_graph=in_graph)


class FakeGraph:
    resets = 0

    def reset(self) -> None:
        self.resets += 1


@pytest.mark.parametrize("ending", ["returns", "bug", "exit"])
def test_the_graph_is_released_however_the_run_ends(graphs, monkeypatch, ending):
    """main() with a GPU: whatever train_mp.main does after capture, the graph is reset
    once before main() hands over to run_main (which then shuts the process groups down)."""
    graph, steps = FakeGraph(), []

    def train(cfg, step):
        step.graph = graph  # what prepare() leaves behind
        steps.append(step)
        if ending == "bug":
            raise RuntimeError("a bug in the loop")
        if ending == "exit":
            raise SystemExit(3)  # preempted

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(graphs.train_mp, "main", train)
    cfg = read_config(CONFIG_FILE, "tiny", environ={}).replace(graph_warmup=4)
    if ending == "returns":
        graphs.main(cfg)
    else:
        with pytest.raises((RuntimeError, SystemExit)):
            graphs.main(cfg)
    assert graph.resets == 1 and steps[0].graph is None
    steps[0].release()  # a second release does nothing
    assert graph.resets == 1
    assert isinstance(steps[0], graphs.GraphedStep) and steps[0].warmup_iters == 4
