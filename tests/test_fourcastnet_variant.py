"""FourCastNet's published architecture as a variant of our AFNO (`afno_variant:
fourcastnet`, networks/afno.py): the modes its code keeps, no final norm, a head without
bias, LayerNorm eps 1e-6; its parameter count by formula; the config that matches the
published model; the refusals of the converter (tools/fourcastnet_weights.py) for files
that are no PhysicsNeMo model. That PhysicsNeMo's own AFNO forecasts as this variant with
its weights: tests/earth2studio_tier/test_fourcastnet_weights.py."""

from __future__ import annotations

import zipfile

import pytest
import torch
from helpers import CONFIG_FILE

from networks.afno import AFNONet, count_parameters
from networks.spectral import kept_modes
from tools.fourcastnet_weights import read_mdlus
from utils.config import read_config
from utils.errors import CheckpointError, ConfigError

TINY = dict(img_size=(16, 32), patch_size=4, in_chans=3, out_chans=3, embed_dim=16, depth=2,
            num_blocks=4)


def test_fourcastnets_modes_are_every_row_and_the_columns_below_the_rows_count():
    published = kept_modes((90, 180), 1.0, fourcastnet=True)
    assert (published.rows, published.kw) == (90, 46)  # of 91 longitude modes
    assert kept_modes((90, 180), 1.0).kw == 91
    assert kept_modes((4, 8), 1.0, fourcastnet=True).kw == 3  # min(8 // 2 + 1, 4 // 2 + 1)
    with pytest.raises(ValueError, match="at hard_thresholding_fraction 1 only, got 0.5"):
        kept_modes((90, 180), 0.5, fourcastnet=True)


def test_the_variant_drops_the_final_norm_and_the_heads_bias_and_narrows_its_norms():
    model = AFNONet(**TINY, variant="fourcastnet")
    assert model.norm is None and model.head.bias is None
    assert model.blocks[0].norm1.eps == model.blocks[1].norm2.eps == 1e-6
    assert model.blocks[0].filter.transform.modes.kw == 3  # 4 x 8 tokens
    assert sum(p.numel() for p in model.parameters()) == count_parameters(
        16, 2, 4, 3, 3, (4, 8), 4, variant="fourcastnet")
    default = AFNONet(**TINY)
    assert default.blocks[0].norm1.eps == 1e-5 and default.blocks[0].filter.transform.modes.kw == 5
    x = torch.randn(2, 3, 16, 32)
    assert model(x).shape == default(x).shape == (2, 3, 16, 32)
    with pytest.raises(ValueError, match="afno_variant 'fcn': expected one of default, "
                                         "fourcastnet"):
        AFNONet(**TINY, variant="fcn")


def test_the_afno_fourcastnet_config_is_the_published_architecture():
    cfg = read_config(CONFIG_FILE, "afno_fourcastnet", environ={})
    assert (cfg.afno_variant, cfg.img_size, cfg.n_in_channels, cfg.patch_size, cfg.embed_dim,
            cfg.depth, cfg.num_blocks) == ("fourcastnet", [720, 1440], 26, 8, 768, 12, 8)
    assert count_parameters(768, 12, 8, 26, 26, (90, 180), 8, variant="fourcastnet") == \
        75_280_128
    with pytest.raises(ConfigError, match="afno_variant fourcastnet is an AFNO with "
                                          "hard_thresholding_fraction 1"):
        read_config(CONFIG_FILE, "tiny", environ={}, flags={"afno_variant": "fourcastnet"})


def test_a_file_that_is_no_physicsnemo_model_is_one_error_line(tmp_path):
    with pytest.raises(CheckpointError, match="is not a PhysicsNeMo .mdlus file"):
        (tmp_path / "x.mdlus").write_text("weights")
        read_mdlus(str(tmp_path / "x.mdlus"))
    with zipfile.ZipFile(tmp_path / "y.mdlus", "w") as archive:
        archive.writestr("args.json", "{}")
    with pytest.raises(CheckpointError, match="y.mdlus holds no model.pt: not a PhysicsNeMo"):
        read_mdlus(str(tmp_path / "y.mdlus"))
