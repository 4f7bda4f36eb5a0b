"""train.py end to end on the tiny config: short subprocess runs in each precision and
optimisation mode, what a run writes (stdout, out.log, TensorBoard), and that it learns.
(User errors, exit code 2 and one `error:` line: test_errors.py.)

Runs are shared where one run can prove several things (the 48-iteration fp32 run backs
the learning, TensorBoard and out.log tests) to keep this file around a minute.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    CONFIG_FILE,
    EPOCH_LINES,
    TINY_ITERS_PER_EPOCH,
    assert_completed,
    layout_of,
    losses,
    run_script,
)

from networks.vit import VisionTransformer
from training.run import lr_factor
from utils.config import read_config
from utils.precision import Precision

SCALARS = ("Loss/train", "Loss/valid", "RMSE(u10m)/valid", "Learning Rate", "Avg iters per sec",
           "Avg samples per sec")
FIGURE = "Visualization, t2m"
TINY_LR = 1.0e-3
ITERS_PER_EPOCH = TINY_ITERS_PER_EPOCH  # tiny: limit_nsamples 32 / global batch 4


def config_value(run, key: str) -> str:
    """A value from the configuration block train.py logs at start-up."""
    m = re.search(rf" - INFO - {re.escape(key)}: (.*)$", run.stdout, re.MULTILINE)
    assert m, f"{key} not in the logged configuration"
    return m.group(1).strip()


def scalars(log_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    values = {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
              for tag in acc.Tags()["scalars"]}
    return values, acc.Tags()["images"]


# ----------------------------------------------------------------- one run, many facts

@pytest.fixture(scope="module")
def learning_run(tiny_data, tmp_path_factory):
    """fp32, 48 iterations = 6 epochs of 8 at the tiny config's lr 1e-3 (cosine to 0)."""
    return run_script("train.py", ["--config=tiny", "--num_iters=48", "--run_num=7"],
                      data_dir=tiny_data, log_dir=tmp_path_factory.mktemp("learn_logs"))


@pytest.mark.e2e
def test_fp32_run_completes_and_prints_the_epoch_lines(learning_run):
    assert_completed(learning_run, 48, epochs=48 // ITERS_PER_EPOCH)
    assert config_value(learning_run, "amp_mode") == "none"


@pytest.mark.e2e
def test_loss_goes_down_over_a_short_run(learning_run):
    assert_completed(learning_run, 48, epochs=6)
    logged = losses(learning_run)
    (initial,), train, val = logged["initial"], logged["train"], logged["val"]
    # The untrained model's relative L2 error is ~1; 48 steps get clearly below it.
    assert initial > 0.9
    assert val[-1] < 0.9 * initial, (initial, val)
    assert train[-1] < 0.9 * initial, (initial, train)
    assert train[-1] < train[0] and val[-1] < val[0]


@pytest.mark.e2e
def test_tensorboard_holds_the_scalars_and_a_figure(learning_run):
    logs = learning_run.exp_dir("tiny", 1, "7") / "logs"
    assert list(logs.glob("events.out.tfevents.*")), f"no event file in {logs}"
    values, images = scalars(logs)
    for tag in SCALARS:
        assert tag in values, (tag, sorted(values))
    assert FIGURE in images
    epochs = list(range(8, 49, 8))
    assert [s for s, _ in values["Loss/valid"]] == [0, *epochs]
    assert [s for s, _ in values["Loss/train"]] == [0, *epochs]
    assert [s for s, _ in values["Learning Rate"]] == epochs
    for tag in SCALARS:
        assert all(math.isfinite(v) for _, v in values[tag]), tag
    assert all(v > 0 for _, v in values["Avg iters per sec"])
    # samples/sec = iters/sec x global batch 4
    for (_, it), (_, sa) in zip(values["Avg iters per sec"], values["Avg samples per sec"],
                                strict=True):
        assert sa == pytest.approx(4 * it, rel=1e-5)
    # the logged lr follows the cosine schedule: lr(step) = 1e-3 * factor(step)
    for step, lr in values["Learning Rate"]:
        assert lr == pytest.approx(TINY_LR * lr_factor(step, 48, 0, "cosine"), abs=1e-9)
    # step 0 of both loss curves is the untrained model's validation loss
    assert values["Loss/train"][0][1] == pytest.approx(values["Loss/valid"][0][1])
    assert values["Loss/valid"][-1][1] < 0.9 * values["Loss/valid"][0][1]


@pytest.mark.e2e
def test_out_log_holds_the_epoch_lines(learning_run):
    out_log = learning_run.exp_dir("tiny", 1, "7") / "out.log"
    assert out_log.is_file()
    text = out_log.read_text()
    for line in EPOCH_LINES:
        assert text.count(line) == 6, line
    assert "Initial val loss=" in text and "CUDA not available" in text
    assert "OpenMP wait policy: " in text  # chosen before torch loaded (utils/openmp.py)


# ----------------------------------------------------------------- precision and speed flags

def short_run(run_train, *flags: str):
    return run_train("train.py", ["--config=tiny", f"--num_iters={ITERS_PER_EPOCH}", *flags])


@pytest.mark.e2e
@pytest.mark.parametrize("flags, resolved", [
    (("--amp_mode=bf16", "--num_data_workers=2", "--skip_initial_validation"),
     {"amp_mode": "bf16", "num_data_workers": "2", "skip_initial_validation": "True"}),
    (("--amp_mode=fp16", "--enable_fused"), {"amp_mode": "fp16", "enable_fused": "True"}),
], ids=["bf16_autocast_with_two_data_workers", "fp16_autocast_with_grad_scaler_and_fused_adam"])
def test_precision_and_loader_flags_train_and_reach_the_config(run_train, flags, resolved):
    run = short_run(run_train, *flags)
    assert_completed(run, ITERS_PER_EPOCH, epochs=1)
    for key, value in resolved.items():
        assert config_value(run, key) == value
    # --skip_initial_validation: the first step comes at once, no step-0 validation
    assert ("Initial val loss=" in run.stdout) == ("--skip_initial_validation" not in flags)


@pytest.mark.e2e
def test_the_latitude_weighted_mse_is_a_loss_a_run_trains_and_validates_with(run_train):
    """--loss weighted_mse: training and validation report the weighted MSE, and it falls.
    The untrained model's output is near zero: its relative L2 error is ~1 (the run above),
    its MSE the targets' weighted mean square, 0.90 on the tiny validation set."""
    run = run_train("train.py", ["--config=tiny", f"--num_iters={3 * ITERS_PER_EPOCH}",
                                 "--loss=weighted_mse"])
    assert_completed(run, 3 * ITERS_PER_EPOCH, epochs=3)
    assert config_value(run, "loss") == "weighted_mse"
    logged = losses(run)
    (initial,), train, val = logged["initial"], logged["train"], logged["val"]
    assert initial < 0.95, initial
    assert val[-1] < 0.9 * initial and train[-1] < train[0], logged


# torch.compile runs (cold and warm cache, what they log): test_compile_cache.py


def test_grad_scaler_is_enabled_only_for_fp16_and_a_scaled_fp16_step_trains(tmp_path):
    from networks.loss import RelativeL2Loss
    from training.profiling import StepProfiler
    from training.step import Step

    cpu = torch.device("cpu")
    for mode, enabled in (("none", False), ("bf16", False), ("fp16", True)):
        assert Precision(mode).grad_scaler().is_enabled() is enabled, mode
    torch.manual_seed(0)
    model = VisionTransformer((16, 32), 4, 20, 20, 32, 1, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = Precision("fp16").grad_scaler()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(2, 20, 16, 32), torch.randn(2, 20, 16, 32)
    prof = StepProfiler(cpu, str(tmp_path), enabled=False)
    # the parts of a Training the step uses, with the tiny config's serial layout
    layout = layout_of(read_config(CONFIG_FILE, "tiny", environ={}))
    run = SimpleNamespace(ctx=SimpleNamespace(precision=Precision("fp16")), layout=layout,
                          model=model, loss=RelativeL2Loss(), optimizer=optimizer,
                          scaler=scaler, prof=prof)
    loss = Step()(run, x, y)
    assert torch.isfinite(loss)
    assert scaler.get_scale() == 65536.0  # finite gradients: no back-off
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)

