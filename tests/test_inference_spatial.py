"""inference.py evaluates the AFNO on a spatial mesh: each rank rolls out and scores its tile
of the grid (distributed/layout.py decides the tiles, the loss and the sums over the mesh),
and the scores equal the serial evaluation's.

A checkpoint of the tiny AFNO (seeded, untrained: the check is about the layout, not about
skill) is evaluated serially and with --h_parallel_size 2 (uneven tiles: 4 token rows of
the 16 x 32 grid split 2 + 2, each rank holding 8 of the 16 pixel rows). The sums over the
tiles add the same terms in another order: rtol 1e-5.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import CONFIG_FILE, layout_of, run_script

LEAD, N_ICS = 3, 4


def save_checkpoint(tiny_data, log_dir) -> str:
    """A tiny_afno checkpoint at <log_dir>/tiny_afno/1CPU/00, as train.py writes it."""
    from networks import build_model
    from training.checkpoint import Checkpointer
    from training.progress import Progress
    from training.run import build_optimizer, build_scheduler
    from utils.config import read_config
    from utils.precision import Precision

    cfg = read_config(CONFIG_FILE, "tiny_afno", environ={"DATA_DIR": str(tiny_data)})
    model = build_model(cfg)
    optimizer = build_optimizer(cfg, model)
    run_dir = log_dir / "tiny_afno" / "1CPU" / "00"
    Checkpointer(str(run_dir), cfg, model, optimizer, build_scheduler(cfg, optimizer),
                 Precision("none").grad_scaler(), layout_of(cfg)).save(Progress())
    return str(run_dir)


def evaluate(run_dir: str, tiny_data, log_dir, out, *flags: str, nproc=None) -> dict:
    args = [f"--run_dir={run_dir}", f"--lead_steps={LEAD}", f"--n_initial_conditions={N_ICS}",
            "--batch_size=2", f"--out={out}", *flags]
    result = run_script("inference.py", args, data_dir=tiny_data, log_dir=log_dir,
                        nproc=nproc, timeout=240)
    assert result.returncode == 0, result.output[-3000:]
    return json.loads((out / "skill.json").read_text())


@pytest.mark.e2e
@pytest.mark.distributed
def test_an_afno_evaluated_on_an_h2_mesh_scores_as_the_serial_evaluation(tiny_data, tmp_path):
    log_dir = tmp_path / "logs"
    run_dir = save_checkpoint(tiny_data, log_dir)
    serial = evaluate(run_dir, tiny_data, log_dir, tmp_path / "serial")
    mesh = evaluate(run_dir, tiny_data, log_dir, tmp_path / "mesh", "--h_parallel_size=2",
                    nproc=2)
    assert serial["layout"] == {"tp": 1, "cp": 1, "h": 1, "w": 1, "dp": 1}
    assert mesh["layout"] == {"tp": 1, "cp": 1, "h": 2, "w": 1, "dp": 1}
    assert mesh["initial_conditions"] == serial["initial_conditions"]
    for name in serial["channels"]:
        for metric in ("rmse", "acc"):
            for forecast in ("model", "persistence", "climatology"):
                np.testing.assert_allclose(mesh["channels"][name][metric][forecast],
                                           serial["channels"][name][metric][forecast],
                                           rtol=1e-5, atol=1e-7,
                                           err_msg=f"{name} {metric} {forecast}")
    # the example maps are the whole grid, gathered from the tiles
    assert (tmp_path / "mesh" / "rollout_t2m.png").is_file()
