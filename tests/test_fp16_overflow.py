"""fp16 loss scaling on a model-parallel layout: one overflow verdict per step for the ranks
that share a loss (`Layout.grad_scaler`, distributed/loss_scaling.py).

GradScaler looks for inf/NaN only in the gradients its own rank holds. A tensor-parallel
rank holds its own shard of the column- and row-parallel weights, a spatial rank its tile of
the position embedding: an overflow there is seen by that rank alone. Without an agreement
that rank skips the step and halves its loss scale while the others step and keep theirs.

Here an overflow is forced: at step FAULT_STEP a gradient hook sets one element of a sharded
parameter's gradient to inf on model-parallel rank 1 only (and on data-parallel rank 0 only),
in backward, before DDP's reduction over dp spreads it to that shard's dp partner;
the serial model gets an inf in the same parameter at the same step. The real step
(`training.step.Step`), the config's loss with the layout's sums over tiles, the layout's
loss scaler, and the model and optimizer that
train_mp.py builds (`wrap_model`: DDP over dp; `build_optimizer`: Adam, or fused Adam, whose
step finds the overflow another way) then train the tiny ViT (tp 2, and dp 2 x tp 2) and the
tiny AFNO (h 2 x w 1) in fp16 autocast on the CPU, beside the serial model. After every step:
  - every rank skipped the faulty step (no parameter moved), like the serial run, and only
    that one;
  - the loss scale is the same on every rank, and the serial run's;
  - the loss equals the serial loss within LOSS_RTOL, and each parameter tensor (gathered)
    the serial one within PARAM_RTOL of its norm (relative L2 error).
Tolerances (fp16 autocast, lr 1e-3, 6 steps; measured on an AMD EPYC with AVX-512, where
fp16 is emulated): losses <= 6e-7 apart; parameters <= 0.18 % (ViT) and <= 1.06 % (AFNO,
whose spectral filter weights are the noisiest). fp16 rounds every product to ~5e-4, and
Adam's first steps move each entry by about lr whatever its gradient's size, so rounding
that flips the sign of a near-zero gradient moves that entry by 2 lr: a norm-relative error
is robust to those few entries, an entry-wise bound is not. With one plain GradScaler per
rank (before the agreement) the same runs part at the faulty step: rank 1 skips alone, the
scales become 65536 and 32768, and the parameters are 43-44 % from the serial ones at once
and 52 % (AFNO) to 65 % (ViT) after 6 steps; the negative control below keeps that in view.

train_mp_graphs.py's CPU fallback (train_mp.py's eager step) is tested end to end in
tests/test_fp16_overflow_scripts.py.
"""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import pytest
import torch
from helpers import CONFIG_FILE, layout_of, run_distributed

STEPS, FAULT_STEP, FAULT_RANK = 6, 2, 1
LOSS_RTOL = 1e-4
PARAM_RTOL = 3e-2
# layout -> (config, sizes, world size)
LAYOUTS = {"tp2": ("tiny", {"tp": 2}, 2),
           "dp2xtp2": ("tiny", {"tp": 2}, 4),
           "h2xw1": ("tiny_afno", {"h_parallel_size": 2}, 2)}


def _sharded_parameter(model: torch.nn.Module) -> str:
    """The first parameter split over a model-parallel group: each rank's gradient of it is
    its own (never all-reduced), so an overflow there is seen by one rank."""
    for name, p in model.named_parameters():
        if any(getattr(p, "sharded_dims_mp", None) or ()):
            return name
    raise AssertionError("no sharded parameter")


def _poison(param: torch.nn.Parameter, clock: list[int]) -> None:
    """At step FAULT_STEP, one element of `param`'s gradient becomes inf."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if clock[0] != FAULT_STEP:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    param.register_hook(hook)


def _moved(before: list[torch.Tensor], model: torch.nn.Module) -> bool:
    return any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def _train(config: str, sizes: dict[str, int], fused: bool, agree: bool) -> list[dict]:
    """STEPS fp16 steps of the layout and of the serial model on every rank; what this rank
    saw at each step. `agree` False: one plain GradScaler per rank (the negative control)."""
    from sharded import gather_full_state_dict

    import networks
    from distributed import comm
    from distributed.layout import Layout
    from networks.loss import build_loss
    from training.profiling import StepProfiler
    from training.run import build_optimizer, wrap_model
    from training.step import Step
    from utils.config import read_config
    from utils.precision import Precision
    from utils.tile import Tile

    cfg = read_config(CONFIG_FILE, config, environ={}).replace(enable_fused=fused, **sizes)
    comm.init(tp=cfg.tp, cp=cfg.cp, h=cfg.h_parallel_size, w=cfg.w_parallel_size)
    cpu, fp16 = torch.device("cpu"), Precision("fp16", "cpu")
    layout = layout_of(cfg)
    serial_layout = Layout("serial", cfg.parallel_order, layout.env, cpu, None,
                           Tile.whole(cfg.img_size))
    rows = torch.ones(cfg.img_size[0])  # latitude weights: unused by the relative L2
    clock = [0]
    faulty_rank = comm.get_rank("mp") == FAULT_RANK and comm.get_rank("dp") == 0
    with tempfile.TemporaryDirectory() as tmp:
        prof = StepProfiler(cpu, tmp, enabled=False)
        model = networks.build_model(cfg, layers=layout.layers)
        name = _sharded_parameter(model)
        if faulty_rank:
            _poison(dict(model.named_parameters())[name], clock)
        par = SimpleNamespace(ctx=SimpleNamespace(precision=fp16), layout=layout,
                              loss=build_loss(cfg.loss, rows[layout.tile.rows],
                                              layout.sum_over_grid),
                              model=wrap_model(model, cfg, layout),  # DDP over dp
                              optimizer=build_optimizer(cfg, model), prof=prof,
                              scaler=layout.grad_scaler(fp16) if agree else fp16.grad_scaler())
        serial = networks.build_model(cfg)
        _poison(dict(serial.named_parameters())[name], clock)
        ser = SimpleNamespace(ctx=par.ctx, layout=serial_layout, model=serial,
                              loss=build_loss(cfg.loss, rows),
                              optimizer=build_optimizer(cfg, serial), prof=prof,
                              scaler=serial_layout.grad_scaler(fp16))
        dp, dp_rank = comm.get_size("dp"), comm.get_rank("dp")
        batch = cfg.global_batch_size
        mine = (slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp), slice(None),
                layout.tile.rows, layout.tile.cols)
        step, records = Step(), []
        for clock[0] in range(STEPS):
            g = torch.Generator().manual_seed(100 + clock[0])
            x = torch.randn(batch, cfg.n_in_channels, *cfg.img_size, generator=g)
            y = torch.randn(batch, cfg.n_out_channels, *cfg.img_size, generator=g)
            before = [p.detach().clone() for p in model.parameters()]
            serial_before = [p.detach().clone() for p in serial.parameters()]
            loss = comm.mean_over(step(par, x[mine], y[mine]).reshape(1), "dp")
            serial_loss = step(ser, x, y)
            full = gather_full_state_dict(model)
            records.append({
                "stepped": _moved(before, model), "serial_stepped": _moved(serial_before, serial),
                "scale": par.scaler.get_scale(), "serial_scale": ser.scaler.get_scale(),
                "loss_err": abs(loss.item() / serial_loss.item() - 1),
                "param_err": max(((full[n] - p.detach()).norm() / p.detach().norm()).item()
                                 for n, p in serial.named_parameters())})
    return records


def _table(ranks: list[list[dict]]) -> str:
    """Per step and rank: stepped?, loss scale, parameter error (for failure messages)."""
    return "\n".join(f"step {s}: " + "; ".join(
        f"rank {r}: {'stepped' if rec[s]['stepped'] else 'skipped'} scale "
        f"{rec[s]['scale']:g} param err {rec[s]['param_err']:.2%}"
        for r, rec in enumerate(ranks)) + f" | serial {ranks[0][s]['serial_scale']:g}"
        for s in range(STEPS))


@pytest.mark.distributed
@pytest.mark.parametrize("layout, fused", [("tp2", False), ("tp2", True), ("dp2xtp2", False),
                                           ("dp2xtp2", True), ("h2xw1", False), ("h2xw1", True)],
                         ids=["tp2", "tp2-fused_adam", "dp2xtp2", "dp2xtp2-fused_adam", "h2xw1",
                              "h2xw1-fused_adam"])
def test_an_overflow_on_one_rank_is_skipped_by_every_rank_like_serial(layout, fused):
    config, sizes, world = LAYOUTS[layout]
    ranks = run_distributed(_train, world, config, sizes, fused, True, timeout=240)
    table = _table(ranks)
    serial = ranks[0]
    assert [s["serial_stepped"] for s in serial] == [s != FAULT_STEP for s in range(STEPS)], \
        "the forced overflow did not make the serial run skip its step"
    for rank, seen in enumerate(ranks):
        for s, rec in enumerate(seen):
            assert rec["stepped"] == rec["serial_stepped"], \
                f"{layout}: rank {rank} {'stepped' if rec['stepped'] else 'skipped'} at " \
                f"step {s}, the serial run did not\n{table}"
            assert rec["scale"] == rec["serial_scale"], \
                f"{layout}: rank {rank}'s loss scale at step {s}\n{table}"
            assert rec["loss_err"] <= LOSS_RTOL, (layout, rank, s, rec["loss_err"])
            assert rec["param_err"] <= PARAM_RTOL, \
                f"{layout}: parameters {rec['param_err']:.2%} from serial at step {s}\n{table}"


@pytest.mark.distributed
def test_without_the_agreement_the_ranks_part_ways():
    """Negative control: with one plain GradScaler per rank (what every rank ran before
    the agreement), rank 1 alone skips the faulty step and halves its scale, and the
    parameters leave the serial run's."""
    config, sizes, world = LAYOUTS["tp2"]
    ranks = run_distributed(_train, world, config, sizes, False, False, timeout=240)
    fault = [r[FAULT_STEP] for r in ranks]
    assert [r["stepped"] for r in fault] == [True, False], _table(ranks)
    assert fault[0]["scale"] == 2 * fault[1]["scale"], _table(ranks)
    assert min(r[-1]["param_err"] for r in ranks) > 5 * PARAM_RTOL, _table(ranks)


def test_checkpoints_hold_the_same_scaler_state_in_every_layout():
    """The agreed scaler is a GradScaler: its state (what training/checkpoint.py saves)
    loads into the serial scaler and back, so any layout resumes any fp16 checkpoint."""
    from distributed.loss_scaling import AgreedGradScaler
    from utils.precision import Precision

    agreed, serial = AgreedGradScaler("cpu", None), Precision("fp16").grad_scaler()
    agreed.load_state_dict({**serial.state_dict(), "scale": 1024.0, "_growth_tracker": 7})
    assert agreed.get_scale() == 1024.0 and agreed.state_dict().keys() == \
        serial.state_dict().keys()
    serial.load_state_dict(agreed.state_dict())
    assert serial.state_dict() == agreed.state_dict()
