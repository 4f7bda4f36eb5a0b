"""torch.compile, decided here for the whole run: what compiles (the model, the loss) and
where the compiled kernels are kept. Nothing else in the project calls torch.compile.

`enable_jit` compiles
  - the model, after DDP has wrapped it (`training.run.wrap_model`): Dynamo then splits the
    graph at DDP's gradient buckets, so their all-reduces still overlap the backward;
  - or, under FSDP or activation checkpointing, each block on its own, before FSDP or DDP
    wraps the model (`by_block`): FSDP2's hooks around every block are not compiled, and
    Dynamo would break the whole model's graph at each of them, so each block is compiled
    before `fully_shard` (the order FSDP2 composes with); a recomputed block traced inside
    the whole model becomes a higher-order op that DDP's graph splitter cannot split (it
    falls back to one bucket for the whole graph), while a block compiled on its own is
    called by the eager `checkpoint`, so its forward and its recompute both run the
    compiled code. The blocks share their code: Dynamo compiles one graph for all of them.
    The patch embedding and the head (a few percent of the step) then run eagerly;
  - the loss, when the fields it sees are the whole grid and all of an ensemble's members
    are on this rank: one pass over the output instead of one per small op. On a spatial
    mesh, or with an ensemble's members split over ranks, the loss holds a collective (its
    sums over the tiles, the gather of the members) and stays eager.
Validation runs both eagerly (`eager`): compiling their no-grad variants would cost a
second compile for little gain (docs/benchmarks.md, torch.compile).

Where the kernels are kept: Inductor's on-disk caches (the FX graph cache of compiled kernels
and the AOTAutograd cache of forward/backward graphs; on a GPU Triton's kernels go into a
`triton` folder inside it) live in `TORCHINDUCTOR_CACHE_DIR`. PyTorch's default is a directory
under /tmp, which a cluster node wipes or never shares, so every job would compile from
scratch. Unless the user or the site preset already chose a directory, a run uses
`<log root>/torch_compile_cache/<host name>`: one per node, shared by that node's ranks and
reused by every later job on it; under a capped vector ISA (`ATEN_CPU_CAPABILITY`, what
`make tutorial CPU_CLASS=...` sets) one per cap too, `<host name>-<cap>`: Inductor generates
its C++ kernels for the cap's vector width, but its cache key leaves the cap out, so kernels
generated under the avx2 cap were found under the avx512 cap and corrupted the heap
(`bench_step --table`'s compiled setting aborted; with its own cache it ran). Not one for
all nodes: Inductor serialises its writers with file locks, which a parallel file system
(Lustre) makes slow or unreliable across nodes. Dynamo's Python-bytecode tracing is not
cached; that part is paid by every job (training/compile_cost.py shows both).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket

import torch
import torch.nn as nn

from utils.config_schema import Config

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
CACHE_SUBDIR = "torch_compile_cache"


def node_name() -> str:
    """This node's host name, as a folder name (the short name: `nid001234`)."""
    name = socket.gethostname().split(".")[0]
    return re.sub(r"[^A-Za-z0-9_-]", "_", name) or "localhost"


def cache_folder() -> str:
    """This node's folder of the compile cache: its host name, then the vector ISA that
    ATEN_CPU_CAPABILITY caps Inductor's kernels to, if it does (module docstring)."""
    cap = re.sub(r"[^A-Za-z0-9_]", "_", os.environ.get("ATEN_CPU_CAPABILITY", ""))
    return node_name() + (f"-{cap}" if cap else "")


def use_compile_cache(expdir: str) -> str:
    """Point Inductor's caches at `<expdir>/torch_compile_cache/<cache_folder()>` unless
    TORCHINDUCTOR_CACHE_DIR is set; returns the directory in use. Must run before anything
    asks Inductor for its cache directory: the first `torch.compile`, and (PyTorch 2.13)
    constructing DDP. Inductor then sets the variable to its /tmp default, and every later
    caller keeps that."""
    if not os.environ.get(CACHE_ENV):
        os.environ[CACHE_ENV] = os.path.abspath(os.path.join(expdir, CACHE_SUBDIR,
                                                             cache_folder()))
    return os.environ[CACHE_ENV]


def prepare(cfg: Config) -> None:
    """Before the model is wrapped (DDP asks Inductor for its cache directory): a run that
    compiles keeps its kernels under its log root."""
    if cfg.enable_jit:
        use_compile_cache(cfg.expdir)


def by_block(cfg: Config, fsdp: bool) -> bool:
    """Whether `enable_jit` compiles the model block by block (module docstring): under
    FSDP (`fsdp`: the layout shards the model) or with activation checkpointing."""
    return bool(cfg.enable_jit) and (fsdp or cfg.activation_checkpointing != "none")


def compile_blocks(model: nn.Module, cfg: Config, fsdp: bool) -> nn.Module:
    """Each of `model.blocks` compiled in place (`nn.Module.compile`: parameter names and
    checkpoints unchanged) when `by_block`, before FSDP or DDP wraps the model."""
    if by_block(cfg, fsdp):
        prepare(cfg)
        for block in model.blocks:
            block.compile()
    return model


def compile_model(model: nn.Module, cfg: Config, fsdp: bool = False) -> nn.Module:
    """The model as training runs it: compiled with `enable_jit` (unless its blocks were,
    `compile_blocks`), else itself."""
    if not cfg.enable_jit or by_block(cfg, fsdp):
        return model
    return _compiled(model, cfg)


def describe(cfg: Config, fsdp: bool) -> str | None:
    """What `enable_jit` compiles in this layout, for the run's log; None without it."""
    if not cfg.enable_jit:
        return None
    if by_block(cfg, fsdp):
        why = "FSDP" if fsdp else "activation checkpointing"
        return (f"torch.compile: block by block ({why}: each block compiled before it is "
                "wrapped, its recompute included); patch embedding and head eager")
    return "torch.compile: the whole model in one graph (under DDP split at its gradient buckets)"


def compile_loss(loss: nn.Module, cfg: Config, local: bool) -> nn.Module:
    """The loss as training runs it: compiled with `enable_jit` when it is `local` (its
    fields are the whole grid, its members all on this rank); a loss with collectives (a
    mesh's tiles, members gathered over ens) stays eager (module docstring)."""
    return _compiled(loss, cfg) if cfg.enable_jit and local else loss


def eager() -> contextlib.AbstractContextManager:
    """Everything compiled runs eagerly inside (validation): no second compile for the
    no-grad graphs of blocks compiled in place."""
    return torch.compiler.set_stance("force_eager")


def _compiled(module: nn.Module, cfg: Config) -> nn.Module:
    prepare(cfg)
    return torch.compile(module)
