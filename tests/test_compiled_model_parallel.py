"""torch.compile of the tensor- and context-parallel ViT (`--enable_jit` with --tp / --cp):
Dynamo traces the collectives inside the autograd Functions of distributed/mappings.py into
one graph, and the compiled model trains as the eager one does.

What was found running it first: the compiled layers were right (the losses equal the eager
ones) but every run ended with "gloo threads outlived comm.shutdown()". Dynamo turns an
in-place `dist.all_reduce(x, group=pg)` into a functional collective whose graph takes the
process group object as an input; PyTorch 2.13 keeps that graph alive after the run (a
backward node of the compiled autograd Function outlives it, referenced from C++), so the
group, and gloo's threads with it, lived into interpreter exit, where they can abort a
finished run (tests/test_comm.py says how). Under torch.compile the collectives now name
their group by its string name (distributed/helpers.py): a compiled graph holds no process
group.

  - in-process (2 gloo ranks, Dynamo + AOTAutograd without Inductor's code generation, which
    is what captures the collectives and is fast): tp 2 and cp 2, one graph without breaks,
    loss and every gradient equal to the eager model's (max |err| <= 1e-6 x max |eager|),
    and no gloo thread left after comm.shutdown();
  - end to end: train_mp.py --enable_jit (Inductor) with --tp 2 and with --cp 2 trains like
    train.py's eager serial run (`serial_reference`) within helpers.CPU_FP32: the printed
    losses to 1e-5, the final parameters to 1e-5, Adam's moments to 1e-4 of their largest
    entry (what was measured: docs/model_parallelism.md, "With torch.compile"). About 2
    minutes per run on 2 cores, most of it compiling.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import (
    CONFIG_FILE,
    TINY_ITERS,
    assert_close_rel,
    assert_completed,
    assert_same_training,
    layout_of,
    run_distributed,
    run_script,
)

RTOL = 1e-6


def _compiled_like_eager(tp: int, cp: int) -> tuple[int, int, int]:
    """(graphs compiled, graph breaks, gloo threads left after comm.shutdown())."""
    from sharded import gather_full_grads

    import networks
    from distributed import comm
    from distributed.helpers import sync_shared_gradients
    from networks.loss import l2_loss
    from utils.config import read_config

    comm.init(tp=tp, cp=cp)
    cfg = read_config(CONFIG_FILE, "tiny", environ={}).replace(tp=tp, cp=cp)
    layers = layout_of(cfg).layers
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, cfg.n_in_channels, *cfg.img_size, generator=g)
    y = torch.randn(4, cfg.n_out_channels, *cfg.img_size, generator=g)
    from torch._dynamo.utils import counters

    results = []
    torch._dynamo.reset()
    counters.clear()
    for compiled in (False, True):
        model = networks.build_model(cfg, layers=layers)  # the same weights: (seed, name)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        loss = l2_loss(run(x), y)
        loss.backward()
        sync_shared_gradients(model)
        results.append((loss.detach(), gather_full_grads(model)))
    (eager_loss, eager), (loss, grads) = results
    where = f"tp={tp} cp={cp}"
    assert_close_rel(loss, eager_loss, f"{where} compiled loss", RTOL)
    for name, grad in eager.items():
        assert_close_rel(grads[name], grad, f"{where} compiled grad of {name}", RTOL)
    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    comm.shutdown()
    return graphs, breaks, comm.gloo_threads()


@pytest.mark.distributed
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("tp, cp", [(2, 1), (1, 2)], ids=["tp2", "cp2"])
def test_the_compiled_layers_equal_eager_in_one_graph_and_hold_no_process_group(tp, cp):
    for graphs, breaks, threads in run_distributed(_compiled_like_eager, 2, tp, cp,
                                                   timeout=240):
        assert (graphs, breaks) == (1, 0)
        assert threads == 0, f"{threads} gloo threads outlived comm.shutdown()"


@pytest.mark.e2e
@pytest.mark.parametrize("flag", ["--tp=2", "--cp=2"])
def test_train_mp_compiled_trains_like_eager_train_py(serial_reference, tiny_data,
                                                       tmp_path_factory, flag):
    run = run_script("train_mp.py", ["--config=tiny", f"--num_iters={TINY_ITERS}", flag,
                                     "--enable_jit"],
                     data_dir=tiny_data, log_dir=tmp_path_factory.mktemp("logs"), nproc=2,
                     env_extra={"TORCHINDUCTOR_COMPILE_THREADS": "1"}, timeout=300)
    assert_completed(run, TINY_ITERS)  # run_script: no gloo thread outlived shutdown
    assert "torch.compile" in run.stdout and "for 2 graphs" in run.stdout, run.stdout[-2000:]
    assert_same_training(run, serial_reference, world_size=2)
