"""The one place a GPU's `torch.device` is made: always with its index.

PyTorch reads a bare `torch.device("cuda")` differently at each door: `torch.cuda.set_device`
refuses it ("Expected a torch.device with a specified index"), `init_process_group(device_id=)`
refuses it, DDP's `device_ids=[device.index]` and DALI's `device_id` turn it into None (the
CPU, for DALI). Every device the GPU branch hands to PyTorch (training's `comm.init_process`,
`make gpu-check`, the DALI loader) is made here, so each carries the GPU it means.

    gpu(local_rank)          # torch.device("cuda", local_rank)
    of_kind("cuda")          # the first visible GPU; of_kind("cpu"): the CPU
    current_gpu()            # the GPU torch.cuda.set_device chose for this process
"""

from __future__ import annotations

import torch

KINDS = ("cuda", "cpu")


def gpu(index: int) -> torch.device:
    """GPU `index` (among those this process sees), as a device that names it."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"GPU index {index!r}: expected an integer >= 0")
    return torch.device("cuda", index)


def of_kind(kind: str, index: int = 0) -> torch.device:
    """The device of a `--device cuda|cpu` flag: GPU `index` (default the first visible)
    or the CPU."""
    if kind == "cuda":
        return gpu(index)
    if kind == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device {kind!r}: expected one of {', '.join(KINDS)}")


def current_gpu() -> torch.device:
    """The GPU this process uses (`torch.cuda.set_device`'s, else the first visible)."""
    return gpu(torch.cuda.current_device())
