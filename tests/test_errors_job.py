"""A bad input in a 2-rank torchrun job: exactly one `error:` line, from the rank that failed
first, no traceback from the workers (only torchrun's own summary, which ends with
ChildFailedError), and torchrun's summary names that rank, with exit code 2, as the root
cause. torchrun itself exits 1 whenever a worker fails (docs/troubleshooting.md, "Exit codes").

  - every rank fails alike before the process group exists (a bad config value, a bad
    flag): rank 0 prints;
  - every rank fails alike after agreeing (NaN data in a sample only rank 1 reads: the loss
    check is an all-reduce, then every rank reads its own batch again and they pool what
    they found): rank 0 prints the sample;
  - one rank fails alone (a damaged chunk only rank 1 reads): rank 1 prints
    `error: rank 1: ...`; rank 0, whose collective then finds the connection closed, exits
    quietly.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from bad_data import copy_data, damage_chunk, first_batch_rows, rewrite, set_value
from helpers import TrainRun, run_script

TIMEOUT = 240
pytestmark = [pytest.mark.distributed, pytest.mark.e2e]


def rank1_only_row(tiny_params) -> int:
    """A row of 2017.h5 that rank 1 reads for its first batch and rank 0 does not."""
    tiny_params = tiny_params.replace(local_batch_size=tiny_params.global_batch_size // 2)
    mine = first_batch_rows(tiny_params, rank=1, world=2)
    theirs = first_batch_rows(tiny_params, rank=0, world=2)
    rows = sorted(row for name, row in mine - theirs if name == "2017.h5")
    assert rows, (mine, theirs)
    return rows[0]


def bad_config_value(tiny_data, tmp, row):
    return ["--num_iters=0"], tiny_data, 0, ["error: bad value --num_iters 0"]


def bad_flag(tiny_data, tmp, row):
    return ["--amp_mode=fp8"], tiny_data, 0, ["train.py: error:", "--amp_mode", "fp8"]


def nan_in_a_sample_of_rank_1(tiny_data, tmp, row):
    data = copy_data(tiny_data, tmp / "data")
    set_value(data / "train" / "2017.h5", row=row, channel=2, value=np.nan)
    return [], data, 0, [f"error: {data / 'train' / '2017.h5'}: sample {row} of 'fields'",
                         "channel 2 (t2m)", "NaN", "iteration 1"]


def damaged_chunk_read_by_rank_1(tiny_data, tmp, row):
    data = copy_data(tiny_data, tmp / "data")
    rewrite(data / "train" / "2017.h5", compression="gzip")
    damage_chunk(data / "train" / "2017.h5", row=row)
    return [], data, 1, [f"error: rank 1: {data / 'train' / '2017.h5'}: cannot read sample "
                         f"{row} of 'fields'"]


def root_cause(run: TrainRun) -> tuple[int, int]:
    """(rank, exit code) that torchrun's summary names as the root cause."""
    section = run.output.split("Root Cause (first observed failure):")[-1]
    rank = re.search(r"rank\s*:\s*(\d+)", section)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", section)
    assert rank and code, run.output[-3000:]
    return int(rank.group(1)), int(code.group(1))


@pytest.mark.parametrize("make", [bad_config_value, bad_flag, nan_in_a_sample_of_rank_1,
                                  damaged_chunk_read_by_rank_1], ids=lambda f: f.__name__)
def test_one_error_line_per_job_from_the_first_failing_rank(tiny_data, tiny_params, tmp_path,
                                                            make):
    args, data, printer, words = make(tiny_data, tmp_path, rank1_only_row(tiny_params))
    run = run_script("train.py", ["--config=tiny", *args], data_dir=Path(data),
                     log_dir=tmp_path / "logs", nproc=2, timeout=TIMEOUT)
    assert run.returncode == 1, run.output[-3000:]  # torchrun: some worker failed
    errors = [line for line in run.output.splitlines() if "error:" in line]
    assert len(errors) == 1, "\n".join(errors) or run.output[-3000:]
    for word in words:
        assert word in errors[0], (word, errors[0])
    # The only traceback is torchrun's own, ending in its summary of the failed workers.
    assert run.output.count("Traceback (most recent call last)") == 1, run.output[-4000:]
    assert "ChildFailedError" in run.output.split("Traceback (most recent call last)")[1]
    assert root_cause(run) == (printer, 2)


def test_a_bad_inference_flag_in_a_2_rank_job_is_one_usage_and_one_error_line(tiny_data,
                                                                             tmp_path):
    """inference.py parses its flags as the train scripts do (utils.config.FlagParser, at
    start-up): rank 0 prints argparse's usage and error, rank 1 nothing."""
    run = run_script("inference.py", ["--lead_steps=many"], data_dir=tiny_data,
                     log_dir=tmp_path / "logs", nproc=2, timeout=TIMEOUT)
    assert run.returncode == 1, run.output[-3000:]  # torchrun: some worker failed
    lines = run.output.splitlines()
    assert sum(line.startswith("usage: inference.py") for line in lines) == 1, run.output
    errors = [line for line in lines if "error:" in line]
    assert errors == ["inference.py: error: argument --lead_steps: invalid int value: 'many'"], \
        run.output[-3000:]
    assert root_cause(run) == (0, 2)
