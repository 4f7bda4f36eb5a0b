"""An ensemble's members in one process: the noise they are conditioned on
(networks/noise.py, networks/ensemble.py) and how training draws and uses it
(training/step.py).

  - an untrained ensemble (zero modulation) is the deterministic model, member for member,
    ViT and AFNO; its first gradient still reaches the modulation (training can grow
    spread);
  - the noise is a pure function of its key: the same members on any layout (a rank's
    members and tile are slices of the whole), other noise for another iteration, sample,
    member or rollout step; training draws it from the iteration alone (a resumed run
    draws the same);
  - a rollout gives every member fresh noise at every step, and member m's forecast is the
    model run with member m's noise;
  - activation checkpointing recomputes with the same noise: the same gradients;
  - a deterministic model refuses noise and an ensemble model wants it (one line each).
Ensemble parallelism against the serial ensemble: tests/test_ensemble_parallel.py.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import CONFIG_FILE, one_line

from networks import build_model
from networks.ensemble import FORECAST, TRAINING, VALIDATION, Members
from networks.loss import build_loss
from networks.rollout import rollout
from training.step import forward_backward, member_noise
from utils.config import read_config
from utils.config_schema import Config
from utils.precision import Precision

SHAPE = dict(img_size=[16, 32], patch_size=4, n_in_channels=3, n_out_channels=3, seed=3,
             loss="crps", ensemble_size=4)
GRID = (4, 8)  # tokens of SHAPE


def _config(model: str = "vit", **more) -> Config:
    section = "tiny_afno" if model == "afno" else "tiny"
    extra = {"embed_dim": 16, "num_blocks": 4} if model == "afno" else {}
    return read_config(CONFIG_FILE, section, environ={}).replace(**{**SHAPE, **extra, **more})


def _members(first: int = 0, count: int = 4, rows: slice = slice(0, 4),
             cols: slice = slice(0, 8), dp_rank: int = 0, dp_size: int = 1) -> Members:
    return Members(size=4, first=first, count=count, noise_channels=2, grid=GRID, rows=rows,
                   cols=cols, seed=7, dp_rank=dp_rank, dp_size=dp_size)


@torch.no_grad()
def _modulate(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its noise modulation as after training (seeded): members that differ."""
    for i, block in enumerate(model.blocks):
        block.noise_mod.linear.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(i))
    return model


@pytest.mark.parametrize("model", ["vit", "afno"])
def test_an_untrained_ensemble_is_the_deterministic_model(model: str) -> None:
    cfg = _config(model)
    ensemble = build_model(cfg)
    deterministic = build_model(cfg.replace(loss="weighted_mse", ensemble_size=1))
    shared = dict(deterministic.named_parameters())
    for name, p in ensemble.named_parameters():  # the same initial weights, and more
        if name in shared:
            assert torch.equal(p, shared[name]), name
        else:
            assert name.startswith("noise_embed.") or ".noise_mod." in name, name
    x = torch.randn(2, 3, 16, 32)
    want = deterministic(x)
    for seed in range(2):
        noise = torch.randn(2, cfg.noise_channels, *GRID,
                            generator=torch.Generator().manual_seed(seed))
        assert torch.equal(ensemble(x, noise), want)
    # ... and the crps loss's first gradient reaches the zero modulation: spread can grow
    loss = build_loss("crps", torch.ones(16))
    noise = torch.randn(2, 4, cfg.noise_channels, *GRID)
    loss(rollout(ensemble, x, 1, noise[None])[:, 0], torch.randn(2, 3, 16, 32)).backward()
    assert ensemble.blocks[0].noise_mod.linear.weight.grad.abs().max() > 0


def test_noise_is_a_function_of_its_key_and_the_same_on_any_layout() -> None:
    whole = _members()
    noise = whole.noise(TRAINING, 5, [0, 1, 2], steps=2)
    assert noise.shape == (2, 3, 4, 2, *GRID) and noise.dtype == torch.float32
    assert torch.equal(noise, whole.noise(TRAINING, 5, [0, 1, 2], steps=2))  # no RNG state
    assert 0.9 < noise.std().item() < 1.1
    # a rank's members and its tile of the grid: slices of the whole ensemble's noise
    part = _members(first=2, count=2, rows=slice(1, 3), cols=slice(4, 8))
    assert torch.equal(part.noise(TRAINING, 5, [0, 1, 2], 2), noise[:, :, 2:, :, 1:3, 4:])
    # a sample's noise does not depend on the batch it is in
    assert torch.equal(whole.noise(TRAINING, 5, [2], 2)[:, 0], noise[:, 2])
    # another iteration, stream, sample, member or step: other numbers
    others = [whole.noise(TRAINING, 6, [0], 1), whole.noise(VALIDATION, 5, [0], 1),
              whole.noise(FORECAST, 5, [0], 1), whole.noise(TRAINING, 5, [3], 1)]
    for other in others:
        assert not torch.allclose(other[0, 0], noise[0, 0])
    assert not torch.allclose(noise[0, 0, 0], noise[0, 0, 1])  # members
    assert not torch.allclose(noise[0, 0], noise[1, 0])  # rollout steps


def test_noise_is_numpys_draw_for_its_key_the_same_numbers_as_ever() -> None:
    """Each member's noise is numpy's standard normal draw seeded with (seed, key), cut to
    the rank's tokens; on the CPU a plain tensor (page-locked memory is for a GPU's copy,
    tests/gpu/test_gpu_training.py). The values pinned below were drawn by the first
    implementation: a change of how the noise is drawn or copied must not change them."""
    part = _members(first=2, count=2, rows=slice(1, 3), cols=slice(4, 8))
    noise = part.noise(TRAINING, 5, [0, 7], steps=2)
    assert noise.device.type == "cpu" and not noise.is_pinned()
    for k in range(2):
        for b, sample in enumerate([0, 7]):
            for m, member in enumerate(part.ids):
                seq = np.random.SeedSequence(7, spawn_key=(TRAINING, 5, sample, member, k))
                want = np.random.default_rng(seq).standard_normal((2, *GRID), dtype=np.float32)
                assert np.array_equal(noise[k, b, m].numpy(), want[:, 1:3, 4:8])
    assert noise.flatten()[:4].tolist() == [-0.029895536601543427, 0.5922718048095703,
                                            -0.5302841663360596, 1.081549048423767]
    assert noise.double().sum().item() == pytest.approx(-6.211741039296612, abs=1e-12)
    forecast = part.noise(FORECAST, 0, [1461], steps=1)
    assert forecast.flatten()[:3].tolist() == [-0.11275392025709152, -0.23292629420757294,
                                               -1.1046806573867798]


def test_samples_are_numbered_as_the_sampler_deals_them() -> None:
    # rank r of R gets every R-th sample of the global order: its i-th is r + R i
    assert _members(dp_rank=1, dp_size=2).samples(0, 3) == [1, 3, 5]
    assert _members(dp_rank=1, dp_size=2).samples(3, 2) == [7, 9]
    assert _members().samples(2, 2) == [2, 3]


def test_training_draws_each_iterations_noise_from_the_iteration_alone() -> None:
    run = SimpleNamespace(members=_members(), progress=SimpleNamespace(iters=12))
    x, y = torch.zeros(2, 3, 16, 32), torch.zeros(2, 2, 3, 16, 32)  # a 2-step rollout
    noise = member_noise(run, x, y)
    assert torch.equal(noise, _members().noise(TRAINING, 12, [0, 1], 2))
    run.progress.iters = 13
    assert not torch.equal(member_noise(run, x, y), noise)
    assert member_noise(SimpleNamespace(), x, y) is None  # a deterministic run


def test_each_member_rolls_out_with_its_own_fresh_noise() -> None:
    model = _modulate(build_model(_config()))
    with torch.no_grad():
        x = torch.randn(2, 3, 16, 32)
        noise = torch.randn(3, 2, 4, 4, *GRID)  # 3 steps, 2 samples, 4 members
        out = rollout(model, x, 3, noise)
        assert out.shape == (2, 3, 4, 3, 16, 32)
        b, m = 1, 2
        state = x[b:b + 1]
        for k in range(3):
            state = model(state, noise[k, b, m][None])
            torch.testing.assert_close(out[b, k, m], state[0], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(out[:, :, 0], out[:, :, 1])  # members differ
        fixed = noise.clone()
        fixed[1] = noise[0]  # the same noise at step 2 as at step 1
        assert torch.equal(rollout(model, x, 3, fixed)[:, 0], out[:, 0])
        assert not torch.allclose(rollout(model, x, 3, fixed)[:, 1], out[:, 1])


def test_recompute_uses_the_noise_drawn_before_the_step() -> None:
    grads = []
    for recompute in ("none", "blocks"):
        cfg = _config(activation_checkpointing=recompute, rollout_steps=2)
        model = build_model(cfg)
        _modulate(model)
        run = SimpleNamespace(
            model=model, loss=build_loss("crps", torch.ones(16)),
            ctx=SimpleNamespace(precision=Precision("none", "cpu")),
            scaler=torch.amp.GradScaler("cpu", enabled=False),
            layout=SimpleNamespace(reduces_after_backward=False),
            prof=SimpleNamespace(range=lambda name: contextlib.nullcontext()),
            members=Members(4, 0, 4, cfg.noise_channels, GRID, slice(0, 4), slice(0, 8), 7),
            progress=SimpleNamespace(iters=3))
        x = torch.randn(2, 3, 16, 32, generator=torch.Generator().manual_seed(1))
        y = torch.randn(2, 2, 3, 16, 32, generator=torch.Generator().manual_seed(2))
        forward_backward(run, x, y, member_noise(run, x, y))
        grads.append([p.grad.clone() for p in model.parameters()])
    for recomputed, kept in zip(*grads, strict=True):
        torch.testing.assert_close(recomputed, kept, rtol=1e-6, atol=1e-8)


def test_noise_is_for_ensembles_only() -> None:
    x = torch.randn(1, 3, 16, 32)
    with pytest.raises(ValueError) as e:
        build_model(_config(loss="weighted_mse", ensemble_size=1))(x, torch.randn(1, 4, *GRID))
    assert "a deterministic model (noise_channels 0) takes no noise" in one_line(e)
    with pytest.raises(ValueError) as e:
        build_model(_config())(x)
    assert "an ensemble member needs its noise" in one_line(e)
    with pytest.raises(ValueError) as e:
        build_model(_config())(x, torch.randn(1, 4, 8, 4))
    assert "expected (B, 4, 4, 8)" in one_line(e)


def test_a_config_that_asks_for_an_ensemble_gets_four_members() -> None:
    from utils.config import load_config

    assert load_config(["--config=tiny", "--loss", "crps"], "test").ensemble_size == 4
    assert load_config(["--config=tiny"], "test").ensemble_size == 1
    assert load_config(["--config=tiny_ens", "--ensemble_size", "8"], "test").ensemble_size == 8
