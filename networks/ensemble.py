"""An ensemble forecast's members on this rank, and the noise that makes them differ.

An ensemble of E members per initial condition is one network (networks/noise.py says how
it is conditioned on noise) run E times, each member with its own noise. With ensemble
parallelism the E members of every sample are split over the `ens` ranks: rank e holds
the global members e E/ens .. (e + 1) E/ens - 1 (contiguous, so the gather over ens
puts them back in order); `Members` says which, and draws their noise.

The noise is a pure function of its key, never of a random state:

    (run seed, stream, index, sample, global member id, rollout step)
        stream, index: TRAINING and the iteration, VALIDATION and 0, FORECAST and 0
        sample: the sample's place in the order the data are dealt out (`samples`), for
            validation and forecasts its index in the data set: its initial time

Each key seeds its own stream (numpy's SeedSequence with the key as its spawn key: streams
that are independent by construction), drawn on the whole token grid, (noise_channels, h, w),
then cut to this rank's tokens (`rows`, `cols`: the AFNO's tile on a spatial mesh; the ViT
splits its tokens over cp itself, as it splits the image's). So:
  - a member's noise is the same on any layout (dp, ens, tp, cp, h x w): the same
    ensemble, whichever ranks compute it;
  - nothing to save for resuming: a resumed run draws the same noise at the same iteration;
  - it is drawn before the step (training/step.py), outside the forward pass, so a
    recomputed block, a compiled graph and a captured CUDA graph all see a tensor given
    to them, never an RNG call of their own;
  - every rollout step has fresh noise (its own key).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# The streams of noise, by what it is for: each its own keys, so a validation or a
# forecast never repeats a training draw.
TRAINING, VALIDATION, FORECAST = 0, 1, 2


@dataclass(frozen=True)
class Members:
    """The members this rank computes: `count` of the `size` members of every sample, the
    first being global member `first`; their noise (`noise_channels` per token) on this
    rank's `rows` x `cols` of the whole `grid` of tokens; samples dealt to data-parallel rank
    `dp_rank` of `dp_size` (`samples`)."""

    size: int
    first: int
    count: int
    noise_channels: int
    grid: tuple[int, int]
    rows: slice
    cols: slice
    seed: int
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.first < self.first + self.count <= self.size:
            raise ValueError(f"members {self.first}..{self.first + self.count - 1} are not "
                             f"among the {self.size} of the ensemble")

    @property
    def ids(self) -> range:
        """The global ids of this rank's members."""
        return range(self.first, self.first + self.count)

    @property
    def is_split(self) -> bool:
        """Whether other ranks hold some of the members (ensemble parallelism)."""
        return self.count < self.size

    def samples(self, seen: int, count: int) -> list[int]:
        """The global places of this rank's next `count` samples, after `seen` of its own:
        the loaders' samplers deal rank r of R every R-th sample of the global order
        (data/dataset.py, `ShardSampler`), so its i-th is the global r + R i. In training
        the order is the iteration's batch; in validation, the data set itself."""
        return [self.dp_rank + self.dp_size * (seen + i) for i in range(count)]

    def noise(self, stream: int, index: int, samples: Sequence[int], steps: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
        """(steps, B, count, noise_channels, rows, cols): N(0, 1) noise of this rank's
        members of `samples` for `steps` rollout steps, keyed as the module docstring says.
        For a GPU it is staged in page-locked memory and copied without blocking: a copy
        from pageable memory would wait for the GPU's queue, every step (on the CPU the
        array drawn is the tensor returned)."""
        shape = (self.noise_channels, *self.grid)
        out = np.empty((steps, len(samples), self.count, self.noise_channels,
                        self.rows.stop - self.rows.start, self.cols.stop - self.cols.start),
                       dtype=np.float32)
        for k in range(steps):
            for b, sample in enumerate(samples):
                for m, member in enumerate(self.ids):
                    key = (stream, index, int(sample), member, k)
                    rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=key))
                    out[k, b, m] = rng.standard_normal(shape, dtype=np.float32)[
                        :, self.rows, self.cols]
        host = torch.from_numpy(out)
        pinned = str(device).startswith("cuda")
        if pinned:
            host = host.pin_memory()
        return host.to(device, non_blocking=pinned)


def member_inputs(x: torch.Tensor, members: int) -> torch.Tensor:
    """(B, ...) -> (B * members, ...): every sample repeated for each of its members
    (sample-major: members of a sample are adjacent)."""
    return x.unsqueeze(1).expand(x.shape[0], members, *x.shape[1:]).flatten(0, 1)
