"""train_mp.py with the training step captured once in a CUDA graph, then replayed.

    torchrun --nproc_per_node 4 train_mp_graphs.py --config=cpu_mp --tp 2   # CPU: runs eagerly
    ENABLE_CUDA_GRAPHS=1 sbatch --nodes 4 submit_pm_mp.sh --config=mp --tp=4

A replay launches the whole forward/backward (and, without loss scaling, the optimizer
step) as one graph: no Python and no per-kernel launch cost. What capture requires, and
this file adds on top of train_mp.py:
  - a warm-up of `--graph_warmup` eager steps on a side stream (DDP needs >= 11 before capture);
  - static input/target buffers: each step copies the batch into them, then replays;
  - gradients set to None before capture, so replays write (not accumulate) them;
  - a capturable Adam whose learning rate lives in a tensor, so the LR schedule still works;
  - fp16: GradScaler.step checks for inf/NaN on the host, so with loss scaling the optimizer
    step runs eagerly after the replay; bf16/fp32 capture the optimizer step too.
Without a GPU it says so and runs train_mp.py's step eagerly.
"""

import logging
import sys

import torch

import train_mp
from distributed.helpers import sync_shared_gradients
from utils.errors import run_main
from utils.loss import l2_loss
from utils.training import autocast

log = logging.getLogger("train_mp_graphs")


class GraphedStep:
    """A `step_fn` for train.train(): eager warm-up, one capture, then replays."""

    def __init__(self, warmup_iters: int = 20):
        self.warmup_iters = warmup_iters
        self.done = 0
        self.graph = None
        self.stream = torch.cuda.Stream()

    def _step_body(self, model, optimizer, scaler, inp, tar, params, device):
        with autocast(params, device):
            loss = l2_loss(model(inp), tar)
        scaler.scale(loss).backward()
        sync_shared_gradients(model)
        if not scaler.is_enabled():
            optimizer.step()
        return loss

    def __call__(self, model, optimizer, scaler, inp, tar, params, device, prof):
        if self.graph is None and self.done < self.warmup_iters:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                loss = self._step_body(model, optimizer, scaler, inp, tar, params, device)
                if scaler.is_enabled():
                    scaler.step(optimizer)
                    scaler.update()
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.current_stream().wait_stream(self.stream)
            self.done += 1
            return loss.detach()
        if self.graph is None:
            self._capture(model, optimizer, scaler, inp, tar, params, device)
        with prof.range("copy batch into static buffers"):
            self.static_inp.copy_(inp)
            self.static_tar.copy_(tar)
        with prof.range("graph replay"):
            self.graph.replay()
        if scaler.is_enabled():
            with prof.range("optimizer"):
                scaler.step(optimizer)
                scaler.update()
        return self.static_loss.detach().clone()

    def _capture(self, model, optimizer, scaler, inp, tar, params, device):
        log.info(f"Capturing the training step in a CUDA graph after {self.done} warm-up steps")
        self.static_inp, self.static_tar = inp.clone(), tar.clone()
        optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_loss = self._step_body(model, optimizer, scaler, self.static_inp,
                                               self.static_tar, params, device)
        # The capture recorded but did not run the step: replay it for this batch.


def main(argv=None):
    argv, warmup = split_graph_args(argv)
    if not torch.cuda.is_available():
        log.warning("CUDA graphs need a GPU: no CUDA device here, so this runs train_mp.py's "
                    "step eagerly (same results, no graph capture)")
        return train_mp.main(argv)
    return train_mp.main(argv, step_fn=GraphedStep(warmup),
                         optimizer_kwargs={"capturable": True})


def split_graph_args(argv):
    """Take --graph_warmup N (default 20) off the command line; the rest is train_mp.py's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(argv):
        if a == "--graph_warmup" or a.startswith("--graph_warmup="):
            value = a.split("=", 1)[1] if "=" in a else argv[i + 1]
            del argv[i:i + (1 if "=" in a else 2)]
            return argv, int(value)
    return argv, 20


if __name__ == "__main__":
    run_main(main, sys.argv[1:])  # exit code 0, 2 (user error) or 3 (preempted)
