"""Which network a config trains: `params.model` is 'vit' (networks/vit.py) or 'afno'
(networks/afno.py). Every script and benchmark builds its model here.

    model = build_model(params)                            # serial: one device, DDP
    model = build_model(params, layers=SpatialLayers())    # train_mp.py: AFNO on h x w

`layers` is the layer factory of the parallel layout (None: serial). The script that set up
the process groups chooses it; the networks never look at them.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from networks import afno, vit
from networks.afno import afno_from_params
from networks.vit import vit_from_params

BUILDERS = {"vit": vit_from_params, "afno": afno_from_params}


def build_model(params: Any, layers: Any = None) -> nn.Module:
    """The network named by `params.model` (default 'vit'), built from the config."""
    return BUILDERS[getattr(params, "model", "vit")](params, layers=layers)


def training_flops(params: Any) -> int:
    """Analytic FLOPs of one training sample of the config's network (forward + backward)."""
    shape = (tuple(params.img_size), params.patch_size, params.n_in_channels,
             params.n_out_channels, params.embed_dim, params.depth)
    ratio = float(getattr(params, "mlp_ratio", 4.0))
    if getattr(params, "model", "vit") == "afno":
        return afno.training_flops_per_sample(
            *shape, params.num_blocks, ratio,
            float(getattr(params, "hard_thresholding_fraction", 1.0)))
    return vit.training_flops_per_sample(*shape, ratio)
