"""fp16 with an overflow on one model-parallel rank, end to end: train_mp_graphs.py on this
CPU (its fallback: train_mp.py's eager step) with --tp 2 (ViT) and --h_parallel_size 2 (AFNO,
h 2 x w 1) trains like train.py with the same fault; and on dp 2 x tp 2 (4 ranks) with fused
Adam, the overflow forced in backward on one rank, before DDP's reduction over dp.

The runs train the tiny model for one epoch (8 steps) in fp16 autocast with loss scaling. At
step FAULT_STEP, tests/overflow_fault.py sets one element of a sharded parameter's gradient to
inf just before the optimizer step, on model-parallel rank 1 of the parallel run and in the
serial run: `blocks.0.mlp.fc1.weight` (column-parallel: each tp rank holds, and alone sees,
half of its rows) or the AFNO's `pos_embed` (each h rank holds its tile's rows). Then, per
step, from what each rank recorded:
  - both ranks skip the faulty step (Adam applies no update) and the serial run does;
  - the loss scale is the same on both ranks and in the serial run (65536, then 32768);
and at the end the final checkpoints' parameters (gathered into full tensors) agree within
PARAM_RTOL of each tensor's norm, and the logged losses within LOSS_RTOL. Measured on an AMD
EPYC with AVX-512 (fp16 emulated): parameters <= 0.3 % (tp 2) and <= 0.7 % (h 2) apart,
losses equal to the last printed digit. Before the agreement (one GradScaler per rank) rank
0 never skipped, the scales parted (65536 vs 32768), the logged train losses differed from
the third decimal (tp 2: 0.969184 vs 0.972478; h 2: 0.973350 vs 0.975104) and the parameters
ended up to 21 % (tp 2) and 24 % (h 2) of a tensor's norm from the serial run's; on dp 2 x
tp 2 the two ranks of tp rank 0 never skipped. Two runs per layout, tiny shapes: well under
a minute each on an idle machine.
"""

from __future__ import annotations

import pytest
from helpers import REPO, assert_completed, final_checkpoint, losses, run_script
from overflow_fault import read_records

ITERS, FAULT_STEP = 8, 3
FLAGS = (f"--num_iters={ITERS}", "--amp_mode=fp16")
# layout -> (config, the parallel run's flags, the parameter whose gradient overflows)
LAYOUTS = {"tp2": ("tiny", ("--tp=2",), "blocks.0.mlp.fc1.weight"),
           "h2xw1": ("tiny_afno", ("--h_parallel_size=2",), "pos_embed")}
PARAM_RTOL, LOSS_RTOL = 3e-2, 1e-4
GRAPHS_MESSAGE = "CUDA graphs need a GPU"


def faulty_run(tmp_path_factory, data, param: str, script: str, mp_rank: int, *flags: str,
               nproc: int | None = None, in_backward: bool = False):
    """`script` with the fault in `param` on model-parallel rank `mp_rank` (in backward, or
    just before the optimizer step): (run, records by rank)."""
    records = tmp_path_factory.mktemp("records")
    where = ["--in_backward"] if in_backward else []
    run = run_script(REPO / "tests" / "overflow_fault.py",
                     [*where, records, param, FAULT_STEP, mp_rank, script, *FLAGS, *flags],
                     data_dir=data, log_dir=tmp_path_factory.mktemp("logs"), nproc=nproc,
                     timeout=240)
    assert_completed(run, ITERS)
    return run, read_records(records)


def skipped(records: dict[int, dict]) -> list[int]:
    """The steps at which Adam applied no update."""
    updates = [0.0] + [records[s]["adam_updates"] for s in range(ITERS)]
    return [s for s in range(ITERS) if updates[s + 1] == updates[s]]


@pytest.mark.e2e
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graphs_script_on_cpu_skips_one_ranks_overflow_on_every_rank_like_train_py(
        tiny_data, tmp_path_factory, layout):
    config, flags, param = LAYOUTS[layout]
    serial, serial_records = faulty_run(tmp_path_factory, tiny_data, param, "train.py", 0,
                                        f"--config={config}")
    graphs, records = faulty_run(tmp_path_factory, tiny_data, param, "train_mp_graphs.py", 1,
                                 f"--config={config}", *flags, nproc=2)
    assert GRAPHS_MESSAGE in graphs.output and "Layout: DP = 1," in graphs.stdout
    assert sorted(records) == [0, 1] and sorted(serial_records) == [0]
    assert skipped(serial_records[0]) == [FAULT_STEP], serial_records
    for rank, mine in records.items():
        assert skipped(mine) == [FAULT_STEP], f"rank {rank}: {mine}"
        scales = [mine[s]["scale"] for s in range(ITERS)]
        assert scales == [serial_records[0][s]["scale"] for s in range(ITERS)], (rank, scales)
    got, want = losses(graphs), losses(serial)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=LOSS_RTOL), (key, got, want)
    a = final_checkpoint(graphs.exp_dir(config, 2), ITERS)["model"]
    b = final_checkpoint(serial.exp_dir(config, 1), ITERS)["model"]
    for name, want_t in b.items():
        err = ((a[name].float() - want_t.float()).norm() / want_t.float().norm()).item()
        assert err <= PARAM_RTOL, f"{name}: {err:.2%} from the serial run's"



@pytest.mark.e2e
def test_dp2_tp2_fused_adam_skips_an_overflow_before_the_dp_reduction_on_every_rank(
        tiny_data, tmp_path_factory):
    """4 ranks, dp 2 x tp 2, fused Adam (whose step takes the overflow flag without
    unscale_): the inf enters one shard's gradient on one rank in backward; DDP spreads it to
    that shard's dp partner, the agreement over "mp" to their tp partners. Every rank skips
    that step, and only that one, as train.py does with the same fault."""
    param, flags = "blocks.0.mlp.fc1.weight", ("--config=tiny", "--enable_fused")
    serial, serial_records = faulty_run(tmp_path_factory, tiny_data, param, "train.py", 0,
                                        *flags, in_backward=True)
    graphs, records = faulty_run(tmp_path_factory, tiny_data, param, "train_mp_graphs.py", 1,
                                 *flags, "--tp=2", nproc=4, in_backward=True)
    assert GRAPHS_MESSAGE in graphs.output and "Layout: DP = 2, TP = 2," in graphs.stdout
    assert sorted(records) == [0, 1, 2, 3]
    assert skipped(serial_records[0]) == [FAULT_STEP], serial_records
    want_scales = [serial_records[0][s]["scale"] for s in range(ITERS)]
    for rank, mine in records.items():
        assert skipped(mine) == [FAULT_STEP], f"rank {rank}: {mine}"
        assert [mine[s]["scale"] for s in range(ITERS)] == want_scales, (rank, mine)
    got, want = losses(graphs), losses(serial)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=LOSS_RTOL), (key, got, want)
    a = final_checkpoint(graphs.exp_dir("tiny", 4), ITERS)["model"]
    b = final_checkpoint(serial.exp_dir("tiny", 1), ITERS)["model"]
    for name, want_t in b.items():
        err = ((a[name].float() - want_t.float()).norm() / want_t.float().norm()).item()
        assert err <= PARAM_RTOL, f"{name}: {err:.2%} from the serial run's"


@pytest.mark.e2e
def test_fsdp_with_tp2_skips_an_overflow_in_one_ranks_slice_on_every_rank(tiny_data,
                                                                         tmp_path_factory):
    """FSDP over dp 2 with tp 2 (4 ranks), fused Adam: each rank holds its own slice of
    every gradient, its tp shard cut again over dp by the reduce-scatter, so an inf there
    (forced after backward on dp rank 0, tp rank 1: world rank 1 alone) is seen by that rank
    alone. The loss scaler's verdict is agreed over every rank (`Layout.grad_scaler`): all
    four skip that step, and only that one, with one loss scale, as train.py does with the
    same fault."""
    param, common = "blocks.0.mlp.fc1.weight", ("--config=tiny", "--enable_fused")
    serial, serial_records = faulty_run(tmp_path_factory, tiny_data, param, "train.py", 0,
                                        *common)
    run, records = faulty_run(tmp_path_factory, tiny_data, param, "train_mp.py", 1, *common,
                              "--tp=2", "--fsdp", nproc=4)
    assert "Layout: DP = 2, FSDP, TP = 2" in run.stdout and sorted(records) == [0, 1, 2, 3]
    assert skipped(serial_records[0]) == [FAULT_STEP], serial_records
    want_scales = [serial_records[0][s]["scale"] for s in range(ITERS)]
    for rank, mine in records.items():
        assert skipped(mine) == [FAULT_STEP], f"rank {rank}: {mine}"
        assert [mine[s]["scale"] for s in range(ITERS)] == want_scales, (rank, mine)
    got, want = losses(run), losses(serial)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=LOSS_RTOL), (key, got, want)
    a = final_checkpoint(run.exp_dir("tiny", 4), ITERS)["model"]
    b = final_checkpoint(serial.exp_dir("tiny", 1), ITERS)["model"]
    for name, want_t in b.items():
        err = ((a[name].float() - want_t.float()).norm() / want_t.float().norm()).item()
        assert err <= PARAM_RTOL, f"{name}: {err:.2%} from the serial run's"
