"""train_mp.py with the training step captured once in a CUDA graph, then replayed.

    torchrun --nproc_per_node 4 train_mp_graphs.py --config=cpu_mp --tp 2   # CPU: runs eagerly
    ENABLE_CUDA_GRAPHS=1 sbatch --nodes 4 submit_pm_mp.sh --config=mp --tp=4

A replay launches the whole forward/backward (and, without loss scaling, the optimizer
step) as one graph: no Python and no per-kernel launch cost. The graph holds the eager
step's own body (`training.step.forward_backward`); what capture requires, and this file
adds on top of train_mp.py:
  - capture before the loop iterates the data loaders, whose threads make CUDA calls of
    their own (pin memory, DALI prefetch): `prepare` warms up and captures on random data,
    then puts the model, optimizer and loss scale back as they were (so the run trains
    exactly as train_mp.py would);
  - a warm-up of `--graph_warmup` eager steps on a side stream created on this rank's
    device (with DDP, dp > 1, at least 11: PyTorch's CUDA-graph notes ask for that many
    before capturing a DDP backward; train_mp.py builds DDP on a side stream too). It also
    creates the loss scale and Adam's state: created inside the capture instead, every
    replay would reset them (the scale to 65536, Adam's moments to 0), so the schema asks
    for at least 3 steps and `check_ready_for_capture` makes sure they exist;
  - static input/target buffers: each step copies the batch into them, then replays (and
    an ensemble's noise, drawn before each step as train_mp.py draws it, into its own);
  - gradients set to None before capture, so replays write (not accumulate) them;
  - a capturable Adam whose learning rate lives in a tensor, so the LR schedule still works;
  - fp16: GradScaler.step checks for inf/NaN on the host, so with loss scaling the optimizer
    step runs eagerly after the replay, and with it the model-parallel ranks' agreement on
    whether the step overflowed (an all-reduce, outside the graph; `Layout.grad_scaler`);
    bf16/fp32 capture the optimizer step too.
  - the graph released (`GraphedStep.release`) however the run ends, before the process
    groups are: NCCL (>= 2.26) destroys a communicator only once every CUDA graph that uses
    it is gone, so a graph left to the interpreter's exit could hang a failed job.
  - the log's memory line of step 2 measured on the last eager warm-up step: a replay
    allocates nothing, so its peak is not the eager step the planner estimates
    (`GraphedStep.measured_memory`; the graph's pool is said beside it).
Without a GPU it says so and runs train_mp.py's step eagerly.
"""

if __name__ == "__main__":
    # First of all, before torch is imported (training/startup.py): a stop signal ends the
    # start-up with one line; the command line's config is read and checked (a bad one: one
    # `error:` line per job); OpenMP's idle threads get their wait policy.
    from training.startup import start

    cfg = start(__doc__, model_parallel=True, script="train_mp_graphs.py")

import logging

import torch
from torch.nn.parallel import DistributedDataParallel

import train_mp
from training.run import Training
from training.script_exit import run_main
from training.setup import memory_since_reset, reset_peak_memory
from training.step import Step, forward_backward, member_noise, optimizer_step
from utils.config_schema import Config
from utils.errors import ConfigError
from utils.model_wrappers import uncompiled

log = logging.getLogger("train_mp_graphs")

DDP_WARMUP = 11  # eager DDP iterations before capturing its backward (PyTorch CUDA notes)


def warmup_steps(requested: int, ddp: bool) -> int:
    """The eager warm-up steps before capture: `requested`, raised to DDP_WARMUP (and said
    in the log) for a model wrapped in DDP, whose backward needs that many before capture."""
    if ddp and requested < DDP_WARMUP:
        log.warning(f"--graph_warmup {requested} raised to {DDP_WARMUP}: a DDP backward "
                    f"needs >= {DDP_WARMUP} eager iterations before CUDA-graph capture")
        return DDP_WARMUP
    return requested


def check_ready_for_capture(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                            optimizer_in_graph: bool) -> None:
    """Raise unless everything the graph reuses exists before capture: the loss scale (and
    its growth tracker) of an enabled scaler, and, when the graph holds the optimizer step,
    the state of every parameter (Adam's `step`, `exp_avg`, `exp_avg_sq`). A tensor created
    inside the capture is created again, with its first value, by every replay."""
    missing = []
    # GradScaler creates both lazily, at its first scale(); it has no public test for them.
    if scaler.is_enabled() and (scaler._scale is None or scaler._growth_tracker is None):
        missing.append("the loss scale")
    if optimizer_in_graph:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        stateless = sum(1 for p in params if not optimizer.state.get(p))
        if stateless:
            missing.append(f"the optimizer state of {stateless} of {len(params)} parameters")
    if missing:
        raise RuntimeError(f"no CUDA-graph capture yet: warm-up has not created "
                           f"{' and '.join(missing)}, which every replay would then reset; "
                           "run eager steps first")


class GraphedStep(Step):
    """A `step` for train.train(): `prepare` captures the graph, each call replays it."""

    capturable = True

    def __init__(self, warmup_iters: int):
        self.warmup_iters = warmup_iters
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_noise: torch.Tensor | None = None  # an ensemble's members' noise
        self.eager_memory: dict[str, float] = {}  # the last warm-up step's (measured_memory)
        self.pool_gb = 0.0

    def _body(self, run: Training, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        """What the graph holds: the eager step's body, and the optimizer step when no
        loss scaling has to look at the gradients on the host first."""
        loss = forward_backward(run, inp, tar, self.static_noise)
        if not run.scaler.is_enabled():
            run.optimizer.step()
        return loss

    def prepare(self, run: Training) -> None:
        """Warm up and capture on random data, then restore the run's state."""
        device = run.device
        ddp = isinstance(uncompiled(run.model), DistributedDataParallel)
        self.warmup_iters = warmup_steps(self.warmup_iters, ddp)
        self.stream = torch.cuda.Stream(device)  # on this rank's GPU, after set_device
        saved = _snapshot(run)
        with torch.random.fork_rng(devices=[device]):
            shape = (run.ctx.local_batch_size, run.cfg.n_in_channels, *run.layout.tile.shape)
            self.static_inp = torch.randn(shape, device=device)
            steps = run.cfg.rollout_steps
            tar_shape = shape if steps == 1 else (shape[0], steps, *shape[1:])
            self.static_tar = torch.randn(tar_shape, device=device)
            noise = member_noise(run, self.static_inp, self.static_tar)  # None: deterministic
            self.static_noise = None if noise is None else torch.randn_like(noise)
            self.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self.stream):
                for i in range(self.warmup_iters):
                    if i == self.warmup_iters - 1:  # warm: the eager step's own peak next
                        reset_peak_memory(device)
                    self._body(run, self.static_inp, self.static_tar)
                    if run.scaler.is_enabled():
                        optimizer_step(run, zero_grad=False)
                    run.optimizer.zero_grad(set_to_none=True)
            torch.cuda.current_stream(device).wait_stream(self.stream)
            self.eager_memory = memory_since_reset(device)
            reserved = torch.cuda.memory_reserved(device)
            check_ready_for_capture(run.scaler, run.optimizer,
                                    optimizer_in_graph=not run.scaler.is_enabled())
            log.info(f"Capturing the training step in a CUDA graph after {self.warmup_iters} "
                     "warm-up steps")
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (loaders) are not this capture's.
            with torch.cuda.graph(self.graph, stream=self.stream,
                                  capture_error_mode="thread_local"):
                self.static_loss = self._body(run, self.static_inp, self.static_tar)
        torch.cuda.synchronize(device)
        self.pool_gb = (torch.cuda.memory_reserved(device) - reserved) / 1024**3
        _restore(run, saved)

    def release(self) -> None:
        """Free the captured graph (once; nothing to do before capture). Not synchronised:
        after an error a replay may still wait for a peer that is gone, and CUDA frees a
        graph that is still running when it completes."""
        graph, self.graph = self.graph, None
        if graph is not None:
            graph.reset()

    def measured_memory(self, device: torch.device) -> tuple[str, dict[str, float]]:
        """A replay allocates nothing (the step's activations live in the graph's private
        pool, counted as reserved), so its peak is not the planner's eager step: the last
        eager warm-up step before capture is, measured on its own in `prepare`. Beside it,
        what capture added to the reserved memory (the graph's pool) and the reserved peak
        while replaying."""
        replaying = memory_since_reset(device)["reserved"]
        return ("a replay allocates nothing: the last eager warm-up step before capture, "
                "its own peak", {**self.eager_memory, "in the graph's pool": self.pool_gb,
                                 "reserved while replaying": replaying})

    def __call__(self, run: Training, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        assert self.graph is not None, "prepare() captures the graph first"
        with run.prof.range("copy batch into static buffers"):
            self.static_inp.copy_(inp)
            self.static_tar.copy_(tar)
            if self.static_noise is not None:
                self.static_noise.copy_(member_noise(run, inp, tar))
        with run.prof.range("graph replay"):
            self.graph.replay()
        if run.scaler.is_enabled():  # the replay wrote the gradients: keep them there
            optimizer_step(run, zero_grad=False)
        return self.static_loss.detach().clone()


def _snapshot(run: Training) -> dict:
    """Copies of everything warm-up changes (parameters, optimizer state, loss scale), kept
    in host memory: on the GPU they would hold another copy of the model and Adam's state
    through warm-up and capture, where the step's own peak comes on top."""
    def host(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    return {"model": [host(t) for t in run.model.state_dict().values()],
            "optimizer": {p: {k: host(v) for k, v in s.items() if torch.is_tensor(v)}
                          for p, s in run.optimizer.state.items()},
            "scaler": run.scaler.state_dict()}


@torch.no_grad()
def _restore(run: Training, saved: dict) -> None:
    """Put the snapshot back *in place*: the graph holds these very tensors."""
    for t, old in zip(run.model.state_dict().values(), saved["model"], strict=True):
        t.copy_(old)
    for p, state in run.optimizer.state.items():
        for k, v in state.items():
            if torch.is_tensor(v):  # state created by warm-up restarts from zero (fresh Adam)
                old = saved["optimizer"].get(p, {}).get(k)
                if old is None:
                    v.zero_()
                else:
                    v.copy_(old)  # from host memory
    if saved["scaler"]:
        run.scaler.load_state_dict(saved["scaler"])  # fills the scale tensor in place


class EagerStep(Step):
    """Without a GPU: train_mp.py's eager step, said once per job in the run's log."""

    def prepare(self, run: Training) -> None:
        log.info("CUDA graphs need a GPU: no CUDA device here, so this runs train_mp.py's "
                 "step eagerly (same results, no graph capture)")


def refuse_what_a_graph_cannot_hold(cfg: Config) -> None:
    """One `error:` line for a flag whose step cannot be captured in one CUDA graph."""
    if cfg.fsdp:
        raise ConfigError("--fsdp: train_mp_graphs.py does not capture it (FSDP gathers "
                          "and frees each block's parameters from Python hooks, on streams "
                          "of its own, around every block); run train_mp.py")
    if cfg.activation_checkpointing != "none":
        raise ConfigError(f"--activation_checkpointing {cfg.activation_checkpointing}: "
                          "train_mp_graphs.py cannot capture it (the recompute saves and "
                          "restores the CUDA RNG state, which a graph capture does not "
                          "allow); run train_mp.py")


def main(cfg: Config) -> None:
    refuse_what_a_graph_cannot_hold(cfg)
    if not torch.cuda.is_available():
        return train_mp.main(cfg, step=EagerStep())
    step = GraphedStep(cfg.graph_warmup)
    try:
        return train_mp.main(cfg, step=step)
    finally:  # however it ends; run_main shuts the process groups down only after this
        step.release()


if __name__ == "__main__":
    run_main(main, cfg)  # exit code 0, 2 (user error) or 3 (preempted)
