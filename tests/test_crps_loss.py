"""The ensemble CRPS loss (networks/loss.py, `loss: crps`) against its definition: a brute-force
double loop over the members in float64, the limits (one member, identical members), the
latitude weighting of the other losses, fp32 under autocast, the fair score in eval mode,
one-line refusals, and a toy y = f(x) + sigma * eps model whose ensemble learns sigma."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.grid import tutorial_grid
from evaluation.regions import latitude_weights
from networks.loss import (
    EnsembleCRPS,
    almost_fair_crps,
    build_loss,
    member_spread_sum,
    spread_weight,
)
from utils.config_schema import Config
from utils.errors import ConfigError

B, C, H, W = 2, 3, 9, 12
GRID = tutorial_grid(H, W)


def brute_force_crps(members: np.ndarray, truth: np.ndarray, alpha: float) -> np.ndarray:
    """CRPS_alpha by its definition, a double loop over the members (axis 0) in float64:
    mean_i |x_i - y| - (1/2) (alpha / (E (E-1)) + (1 - alpha) / E^2) sum_{i,j} |x_i - x_j|."""
    E = len(members)
    skill = sum(np.abs(members[i] - truth) for i in range(E)) / E
    pairs = sum(np.abs(members[i] - members[j]) for i in range(E) for j in range(E))
    w = (alpha / (E * (E - 1)) if E > 1 else 0.0) + (1 - alpha) / E**2
    return skill - 0.5 * w * pairs


def _ensemble(E: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(B, C, H, W, generator=g)
    return truth[:, None] + torch.randn(B, E, C, H, W, generator=g), truth


@pytest.mark.parametrize("E", [2, 3, 5])
def test_the_estimator_equals_a_brute_force_crps(E: int) -> None:
    members, truth = _ensemble(E)
    for alpha in (0.0, 0.95, 1.0):
        want = brute_force_crps(members.double().numpy().swapaxes(0, 1), truth.double().numpy(),
                                alpha)
        got = almost_fair_crps(members, truth, alpha)
        assert got.shape == truth.shape and got.dtype == torch.float32
        np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-6)
    # The sorted form of the pairwise sum, on ties too (members equal in pairs).
    tied = torch.cat([members[:, :1], members[:, :1], members[:, 1:]], dim=1)
    pairs = (tied[:, :, None] - tied[:, None, :]).abs().sum(dim=(1, 2))
    torch.testing.assert_close(member_spread_sum(tied), pairs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("E", [2, 4, 5])
def test_tied_members_get_one_gradient_the_pairwise_sums_with_sign_0_equal_0(E: int) -> None:
    """Where members tie (all of them, as an untrained ensemble's; or some), each gets the
    gradient of sum_ij |x_i - x_j| with sign(0) = 0, the same for every member of a tie,
    whatever order the sort left them in: a member's gradient does not depend on its
    number. Untied, the sorted form's gradient is the pairwise one too."""
    members, _ = _ensemble(E)
    tied = members.clone()
    tied[:, 1] = tied[:, 0]  # a tie of two
    tied[0] = tied[0, :1]  # every member of the first sample the same
    for x in (members, tied):
        got = x.clone().requires_grad_()
        member_spread_sum(got).sum().backward()
        want = x.clone().requires_grad_()
        (want[:, :, None] - want[:, None, :]).abs().sum(dim=(1, 2)).sum().backward()
        assert torch.equal(got.grad, want.grad)
    reversed_ = tied.flip(1).requires_grad_()  # the members numbered the other way round
    member_spread_sum(reversed_).sum().backward()
    assert torch.equal(reversed_.grad.flip(1), got.grad)
    assert torch.equal(got.grad[0], torch.zeros_like(got.grad[0]))  # all tied: no push


def test_one_member_with_alpha_0_is_the_absolute_error() -> None:
    members, truth = _ensemble(1)
    torch.testing.assert_close(almost_fair_crps(members, truth, alpha=0.0),
                               (members[:, 0] - truth).abs())
    with pytest.raises(ConfigError, match="at least 2 members per sample, got 1"):
        almost_fair_crps(members, truth, alpha=0.5)


def test_identical_members_have_zero_spread() -> None:
    members, truth = _ensemble(1)
    same = members.expand(B, 4, C, H, W)
    assert torch.equal(member_spread_sum(same), torch.zeros_like(truth))
    for alpha in (0.0, 0.95, 1.0):  # no spread: every CRPS is the one member's MAE
        torch.testing.assert_close(almost_fair_crps(same, truth, alpha),
                                   (members[:, 0] - truth).abs())


def test_the_spread_weight_mixes_the_fair_and_the_plain_ones() -> None:
    assert spread_weight(4, 1.0) == pytest.approx(1 / 12)  # fair: 1 / (E (E - 1))
    assert spread_weight(4, 0.0) == pytest.approx(1 / 16)  # empirical distribution: 1 / E^2
    assert spread_weight(4, 0.95) == pytest.approx(0.95 / 12 + 0.05 / 16)


def test_the_loss_is_the_latitude_weighted_mean_and_fair_in_eval_mode() -> None:
    members, truth = _ensemble(4)
    w = latitude_weights(GRID)
    rows = torch.from_numpy(w).float()
    loss = build_loss("crps", rows, crps_alpha=0.9)
    assert isinstance(loss, EnsembleCRPS) and loss.training and loss.current_alpha() == 0.9
    x, y = members.double().numpy().swapaxes(0, 1), truth.double().numpy()
    for alpha in (0.9, 1.0):
        want = (brute_force_crps(x, y, alpha) * w[:, None]).mean()
        assert loss(members, truth).item() == pytest.approx(want, rel=1e-5)
        loss.eval()  # validation and evaluation: the fair CRPS
    assert loss.current_alpha() == 1.0
    assert build_loss("crps", rows).alpha == Config.model_fields["crps_alpha"].default
    # bf16 members under autocast: scored in fp32, the gradient back in bf16
    low = members.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = loss(low, truth)
    assert value.dtype == torch.float32
    value.backward()
    assert low.grad.dtype == torch.bfloat16
    want = (brute_force_crps(low.detach().double().numpy().swapaxes(0, 1), y, 1.0)
            * w[:, None]).mean()
    assert value.item() == pytest.approx(want, rel=1e-5)


def test_the_loss_refuses_one_member_and_deterministic_fields_in_one_line() -> None:
    loss = build_loss("crps", torch.ones(H), crps_alpha=0.0)
    members, truth = _ensemble(1)
    for pred, says in ((members, "at least 2 ensemble members per sample, got 1"),
                       (members[:, 0], r"predictions \(B, E, C, H, W\)")):
        with pytest.raises(ConfigError, match=says) as err:
            loss(pred, truth)
        assert "\n" not in str(err.value)


def test_an_ensemble_trained_on_crps_learns_the_noise_of_y_equals_f_of_x_plus_noise() -> None:
    """y = sin(2x) + 0.3 eps: a small network g(x, z) with a N(0, 1) noise input z, trained
    with the almost-fair CRPS on 4 members per x (600 seeded Adam steps, < 1 s), gives an
    ensemble whose spread at each x is sigma (within 10 % on average, 15 % at every x) and
    whose mean is f(x) (within sigma / 2)."""
    sigma, E, batch = 0.3, 4, 256
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.SiLU(), torch.nn.Linear(32, 32),
                              torch.nn.SiLU(), torch.nn.Linear(32, 1))
    ensemble = lambda x, z: net(torch.stack([x[:, None].expand_as(z), z], -1)).squeeze(-1)  # noqa: E731
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(600):
        x = 4 * torch.rand(batch, generator=g) - 2
        y = torch.sin(2 * x) + sigma * torch.randn(batch, generator=g)
        loss = almost_fair_crps(ensemble(x, torch.randn(batch, E, generator=g)), y, 0.95)
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
    with torch.no_grad():
        x = torch.linspace(-1.5, 1.5, 13)
        members = ensemble(x, torch.randn(13, 4000, generator=g))
    spread = members.std(dim=1)
    assert spread.mean().item() == pytest.approx(sigma, rel=0.10), spread
    assert ((spread / sigma - 1).abs() < 0.15).all(), spread
    assert (members.mean(dim=1) - torch.sin(2 * x)).abs().max().item() < sigma / 2
