"""What the checks share: a one-rank process group on the device, a small config, and runs made
of the project's own pieces (the layout, `training.run.build_wrapped_model`, Adam, the loss,
the loss scaler and `training.step.Step`), stepped on random batches kept in memory.

    join(devices.gpu(0))               # once per process: the one-rank group, as a job has
    cfg = small_config(enable_jit=True)
    run = build(cfg, device)           # model (DDP/compile as train.py wraps it), optimizer...
    losses = train(run, batches(cfg, device, 3))
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

from distributed import comm, fsdp
from distributed.layout import Layout
from networks.loss import build_loss
from training import compiling
from training.run import build_optimizer, wrap_model
from training.step import Step
from utils.config import read_config
from utils.config_schema import Config
from utils.precision import Precision

REPO = Path(__file__).resolve().parents[2]
CONFIG_FILE = REPO / "config" / "ViT.yaml"
# The checks' model: the tiny config's ViT on a 12 x 28 grid of patch 4 (21 tokens), 3
# channels: big enough to hold every kind of layer, small enough to compile in seconds.
SMALL = dict(img_size=[12, 28], patch_size=4, embed_dim=32, depth=2, num_heads=4,
             n_in_channels=3, n_out_channels=3, seed=5, lr=1e-3)
BATCH = 4


def join(device: torch.device) -> None:
    """A one-rank process group (NCCL on a GPU, gloo on a CPU) and the layout's named
    groups over it, as a one-process job has them; FSDP's mesh needs a real group. A GPU
    `device` names its index (`utils.devices.gpu`): set_device and device_id refuse one
    without."""
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=300),
                                device_id=device if device.type == "cuda" else None)
    comm.init()


def small_config(expdir: str, **keys: object) -> Config:
    """The checks' small config (SMALL), logging (and caching compiled kernels) in
    `expdir`, with `keys` on top."""
    cfg = read_config(str(CONFIG_FILE), "tiny", environ={})
    return cfg.replace(**{**SMALL, "expdir": expdir, **keys})


class _NoRanges:
    """The step's profiler, here doing nothing."""

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        yield


def layout_of(cfg: Config, device: torch.device) -> Layout:
    return Layout.of_groups(cfg, None, device)


def build(cfg: Config, device: torch.device, model: nn.Module | None = None,
          amp_mode: str | None = None) -> SimpleNamespace:
    """What `training.step.Step` needs of a run: the config's model as train.py wraps it
    (or `model`, already wrapped), Adam (fused if the config says), the loss (compiled with
    `enable_jit`, as training compiles it), the precision (`amp_mode`, default the
    config's: 'auto' as on this device) and its loss scaler."""
    import networks
    from utils.precision import auto_amp_mode

    layout = layout_of(cfg, device)
    if model is None:
        torch.manual_seed(cfg.seed)
        model = wrap_model(networks.build_model(cfg, layers=layout.layers).to(device), cfg,
                           layout)
    mode = amp_mode or cfg.amp_mode
    mode = auto_amp_mode(device) if mode == "auto" else mode
    precision = Precision(mode, device.type)
    loss = build_loss(cfg.loss, torch.ones(cfg.img_size[0], device=device), None)
    loss = compiling.compile_loss(loss, cfg, local=True)  # compiled as training does
    return SimpleNamespace(model=model, optimizer=build_optimizer(cfg, model), layout=layout,
                           prof=_NoRanges(), ctx=SimpleNamespace(precision=precision),
                           loss=loss, scaler=layout.grad_scaler(precision), cfg=cfg)


def fsdp_one_rank(cfg: Config, device: torch.device) -> nn.Module:
    """The config's model sharded by FSDP2 over the one-rank group (what `--fsdp` builds,
    which a job of one data-parallel rank leaves whole), compiled block by block first
    with `enable_jit`, in the order training/run.py's wrap_model uses."""
    import networks

    torch.manual_seed(cfg.seed)
    model = networks.build_model(cfg).to(device)
    model = compiling.compile_blocks(model, cfg, fsdp=True)
    # comm makes no group of one rank: this one-process world is the one-rank dp group
    return fsdp.shard_model(model, fsdp.mesh_of(dist.group.WORLD, device))


def batches(cfg: Config, device: torch.device, n: int, seed: int = 1
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, cfg.n_in_channels, *cfg.img_size)
    return [(torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device))
            for _ in range(n)]


def train(run: SimpleNamespace, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """The losses of `training.step.Step` on each batch in turn."""
    step = Step()
    return [float(step(run, x, y)) for x, y in data]


def parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (FSDP's gathered), on the host."""
    from utils.model_wrappers import unwrap

    return {name: fsdp.gather(p.detach()).float().cpu()
            for name, p in unwrap(model).named_parameters()}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max |a - b|."""
    return max(float((a[k] - b[k]).abs().max()) for k in b)


@contextlib.contextmanager
def fp32_matmuls(device: torch.device) -> Iterator[None]:
    """Plain fp32 matmuls and convolutions (no TF32) for the duration: equality checks
    compare runs at fp32's rounding."""
    if device.type != "cuda":
        yield
        return
    kept = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = kept


def compile_counts() -> dict[str, int]:
    """What Dynamo compiled since `reset_compile_counts`: graphs, graph breaks, and the
    operations captured in them."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": sum(counters["graph_break"].values()),
            "operations": int(counters["stats"]["calls_captured"])}


def reset_compile_counts() -> None:
    from torch._dynamo.utils import counters

    counters.clear()


def compile_threads(device: torch.device) -> None:
    """On a CPU, compile in this process only: no pool of compile workers beside the
    checks (on a GPU the pool compiles Triton's kernels in parallel)."""
    if device.type == "cpu":
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
