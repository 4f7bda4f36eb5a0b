"""FourCastNet's published weights load into our AFNO (tools/fourcastnet_weights.py,
`afno_variant: fourcastnet`): PhysicsNeMo's `AFNO`, the class Earth2Studio's FCN runs, built
with the published architecture (26 channels, patch 8, embed 768, depth 12, 8 blocks) on the
published 720 x 1440 grid has exactly the tensors of our `afno_fourcastnet` config; on a
smaller grid (the same architecture otherwise, random weights), saved as its .mdlus file, converted
and loaded the way `--init_from` loads a checkpoint, our forward equals theirs. Its
arguments must be the config's: a difference is one line. No download: the weights are
random, their shapes the published ones."""

from __future__ import annotations

import importlib
import io
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import pytest
import torch
from e2s_utils import (
    need,
    require_earth2studio,  # noqa: F401  (the fixture)
)
from helpers import CONFIG_FILE

pytestmark = [pytest.mark.earth2studio, pytest.mark.usefixtures("require_earth2studio")]

SMALL = [64, 128]  # 8 x 16 tokens: FourCastNet's modes keep 5 of the 9 longitude ones


def _bare_package(name: str) -> types.ModuleType:
    """Package `name` registered without running its __init__: its submodules still import
    from its folder."""
    parent, _, leaf = name.rpartition(".")
    package = types.ModuleType(name)
    package.__path__ = [f"{path}/{leaf}" for path in sys.modules[parent].__path__]
    sys.modules[name] = package
    setattr(sys.modules[parent], leaf, package)
    return package


def _afno_without_timm() -> type:
    """PhysicsNeMo's AFNO module, imported alone. `physicsnemo.nn` and `physicsnemo.models`
    import every layer and model in their __init__, the DiT's among them, and those import
    timm, which imports torchvision: PyPI's torchvision is a CUDA build, which does not
    load beside a CPU-only torch (`+cpu`). The AFNO and its layers use neither; here they
    are imported from their own files, the code Earth2Studio's FCN runs, unchanged."""
    importlib.import_module("physicsnemo")  # the parent of the bare packages below
    nn_package = _bare_package("physicsnemo.nn")
    _bare_package("physicsnemo.nn.module")
    layers = importlib.import_module("physicsnemo.nn.module.afno_layers")
    for name in ("AFNO2DLayer", "AFNOMlp", "AFNOPatchEmbed"):
        setattr(nn_package, name, getattr(layers, name))
    _bare_package("physicsnemo.models")
    _bare_package("physicsnemo.models.afno")
    return importlib.import_module("physicsnemo.models.afno.afno").AFNO


@pytest.fixture(scope="module")
def physicsnemo_afno():
    """PhysicsNeMo's AFNO class (alone where torchvision cannot load); skips without
    PhysicsNeMo (fails under EARTH2STUDIO_TESTS_REQUIRED)."""
    try:
        from physicsnemo.models.afno import AFNO
    except ImportError as e:  # torchvision missing, or a build of another torch
        if e.name == "physicsnemo":
            need("physicsnemo")
        for name in [n for n in sys.modules if n.startswith(("physicsnemo.", "timm"))]:
            del sys.modules[name]  # what the failed import left half made
        return _afno_without_timm()
    return AFNO


def fourcastnet_config(img_size=None):
    from utils.config import read_config

    cfg = read_config(CONFIG_FILE, "afno_fourcastnet", environ={})
    return cfg.replace(img_size=img_size) if img_size else cfg


def theirs(AFNO, cfg, seed: int = 0):
    torch.manual_seed(seed)
    return AFNO(inp_shape=list(cfg.img_size), in_channels=cfg.n_in_channels,
                out_channels=cfg.n_out_channels, patch_size=[cfg.patch_size] * 2,
                embed_dim=cfg.embed_dim, depth=cfg.depth, num_blocks=cfg.num_blocks).eval()


def test_the_published_architecture_has_exactly_our_fourcastnet_configs_tensors(
        physicsnemo_afno):
    from networks.factory import build_model
    from tools.fourcastnet_weights import to_ours

    cfg = fourcastnet_config()
    published = theirs(physicsnemo_afno, cfg)
    ours = build_model(cfg)
    mapped = to_ours(published.state_dict(), cfg)
    shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    assert {n: tuple(t.shape) for n, t in mapped.items()} == shapes
    assert sum(p.numel() for p in ours.parameters()) == sum(
        p.numel() for p in published.parameters()) == 75_280_128


def as_tar(mdlus: Path) -> Path:
    """The same .mdlus in PhysicsNeMo's older layout: a tar of the same three files (its own
    `save(legacy_format=True)` fails on a local path with this fsspec)."""
    out = mdlus.with_suffix(".tar.mdlus")
    with zipfile.ZipFile(mdlus) as archive, tarfile.open(out, "w") as tar:
        for name in archive.namelist():
            data = archive.read(name)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


@pytest.mark.parametrize("layout", ["zip", "tar"])
def test_their_weights_forecast_in_our_afno_as_in_theirs(physicsnemo_afno, layout, tmp_path):
    from distributed.layout import Layout
    from networks.factory import build_model
    from tools.fourcastnet_weights import convert, save_checkpoint
    from training.checkpoint import load_weights

    cfg = fourcastnet_config(SMALL)
    published = theirs(physicsnemo_afno, cfg, seed=1)
    with torch.no_grad():  # their biases start at zero: give every tensor values
        for p in published.parameters():
            p.add_(0.02 * torch.randn_like(p))
    mdlus = tmp_path / "fcn.mdlus"
    published.save(str(mdlus))  # Earth2Studio's FCN package holds one: fcn.mdlus
    mdlus = as_tar(mdlus) if layout == "tar" else mdlus
    checkpoint = save_checkpoint(convert(str(mdlus), cfg), cfg, str(tmp_path / "run"))
    model = build_model(cfg)  # what train.py --init_from does with the checkpoint
    load_weights(checkpoint, cfg, model, Layout.of_groups(cfg, None, torch.device("cpu")))
    x = torch.randn(2, 26, *SMALL)
    with torch.no_grad():
        expected = published(x)
        torch.testing.assert_close(model.eval()(x), expected, rtol=1e-5,
                                   atol=1e-5 * expected.abs().max().item())
        # The variant matters: our default AFNO with these weights forecasts otherwise.
        assert not torch.allclose(build_model(cfg.replace(afno_variant="default"))(x),
                                  expected, atol=1e-2)


def test_a_published_model_of_another_architecture_is_refused_in_one_line(
        physicsnemo_afno, tmp_path, capsys):
    from tools.fourcastnet_weights import main

    other = physicsnemo_afno(inp_shape=SMALL, in_channels=26, out_channels=26,
                             patch_size=[8, 8], embed_dim=512, depth=1, num_blocks=8)
    other.save(str(tmp_path / "other.mdlus"))
    assert main([str(tmp_path / "other.mdlus"), str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {tmp_path / 'other.mdlus'}: inp_shape [64, 128] in its args.json, "
                   "the config 'afno_fourcastnet' has [720, 1440]: give the config of its "
                   "architecture\n")
    assert not (tmp_path / "run").exists()
