"""Which network a config trains: `cfg.model` is 'vit' (networks/vit.py) or 'afno'
(networks/afno.py). Every script and benchmark builds its model here.

    model = build_model(cfg)                          # serial: one device, DDP
    model = build_model(cfg, layers=layout.layers)    # any layout (distributed/layout.py)

`layers` is the layer factory of the parallel layout (None: serial). The layout decides it
from the process groups; the networks never look at them.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from networks import afno, vit
from networks.afno import afno_from_params
from networks.vit import vit_from_params
from utils.config_schema import Config

BUILDERS = {"vit": vit_from_params, "afno": afno_from_params}


def build_model(cfg: Config, layers: Any = None) -> nn.Module:
    """The network named by `cfg.model`, built from the config."""
    return BUILDERS[cfg.model](cfg, layers=layers)


def training_flops(cfg: Config) -> int:
    """Analytic FLOPs of one training sample of the config's network (forward + backward):
    of all its `ensemble_size` members (the noise conditioning's few per cent left out)."""
    shape = (tuple(cfg.img_size), cfg.patch_size, cfg.n_in_channels, cfg.n_out_channels,
             cfg.embed_dim, cfg.depth)
    if cfg.model == "afno":
        member = afno.training_flops_per_sample(*shape, cfg.num_blocks, cfg.mlp_ratio,
                                                cfg.hard_thresholding_fraction,
                                                variant=cfg.afno_variant)
    else:
        member = vit.training_flops_per_sample(*shape, cfg.mlp_ratio)
    return member * cfg.ensemble_size
