"""The dry run (planning/, `python -m bench.dry_run`) against real jobs, and its parts.

  - On 4 gloo ranks, every layout of the issue in one launch: dp 2 x tp 2, dp 2 x cp 2
    (ViT), h 2 x w 2 (AFNO), FSDP over dp 4, each with and without recompute, an ensemble
    on dp 2 x ens 2, uneven
    splits (35 tokens, a 5 x 7 grid) and DDP in several buckets. Each rank builds what
    the train scripts build (`training.run.wrap_model`: DDP or FSDP2; Adam; the config's
    loss; training/step.py's step) and counts its third step's collectives with the
    recorder (planning/collectives.py); the dry run of the same job, rank by rank on the
    fake backend in this process, counts exactly the same: op, group, bytes, count.
  - A job of 1,024 ranks: every group of every axis checked, start-up's partitions and
    splits counted, the first and last rank built on the fake backend with the groups the
    rank generator says.
  - The command line: one JSON object per rank role with the keys the docs promise; a
    world the layout does not divide, a tp group split across nodes, an unknown GPU: one
    `error:` line each, exit 2.
  - FSDP's chunks made on demand are torch's chunks (the same views).
  - The dry run builds FSDP (`step_trace.fake_model`) where dp divides no dim of some
    parameters, which FSDP2 refused before: `mp` at 12 GPUs, `afno` at 1,024. Every
    tutorial parameter at dp 2, 3, 12, 64 and 1,024: tests/test_fsdp.py.
The time model's formulas and overlap: tests/test_time_model.py.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from helpers import CONFIG_FILE, layout_of, run_distributed
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty
from torch.distributed.tensor import DTensor

from bench import dry_run
from distributed import comm
from distributed.fsdp import shard_dim
from distributed.layout import Layout
from networks import build_model
from planning.collectives import CollectiveRecorder, counted
from planning.fake_world import _Chunks, fake_world, runs_collectives_on_fake_tensors
from planning.planned_job import PlannedJob
from planning.step_trace import Phases, batch, fake_model, step_run
from training.run import build_optimizer, wrap_model
from training.setup import batch_sizes
from training.step import Step
from utils.config import read_config
from utils.config_schema import Config
from utils.errors import UserError
from utils.parallel_axes import config_sizes

RANKS = 4
# 5 x 7 tokens: cp 2 splits them 18 + 17, the AFNO's mesh 3 + 2 rows and 4 + 3 columns; 1.9
# MB of gradients in DDP buckets of 1 MB
SHAPE = dict(img_size=[20, 28], patch_size=4, embed_dim=128, depth=2, bucket_cap_mb=1)
LAYOUTS = {"dp2xtp2": ("tiny", {"tp": 2}), "dp2xcp2": ("tiny", {"cp": 2}),
           "h2xw2": ("tiny_afno", {"h_parallel_size": 2, "w_parallel_size": 2}),
           "fsdp-dp4": ("tiny", {"fsdp": True}),
           # an ensemble's members over ens 2: the loss's gather, the gradients' sum over ens
           "dp2xens2": ("tiny_ens", {"ensemble_parallel_size": 2})}
CASES = [(name, recompute) for name in LAYOUTS for recompute in ("none", "blocks")
         if name != "dp2xens2" or recompute == "none"]  # the members' collectives: once
# The dry run steps on fake tensors through the collectives: an older PyTorch cannot.
FAKE_STEPS = pytest.mark.skipif(not runs_collectives_on_fake_tensors(),
                                reason=f"PyTorch {torch.__version__} has no fake kernels for "
                                "the c10d collectives")
JSON_KEYS = {"dp", "tp", "cp", "h", "w", "fsdp", "flops_per_sample", "samples_per_s", "step_s",
             "peak_gb", "fits", "groups_ok", "collectives", "wall_s"}


def _config(name: str, recompute: str) -> Config:
    section, sizes = LAYOUTS[name]
    return read_config(CONFIG_FILE, section, environ={}).replace(
        **SHAPE, **sizes, activation_checkpointing=recompute)


def _real_steps() -> dict:
    """This rank's third step's collectives in every case (the second rebuilds DDP's
    buckets), built and stepped as the train scripts do."""
    found = {}
    for name, recompute in CASES:
        cfg = _config(name, recompute)
        comm.init(cfg.parallel_order, **config_sizes(cfg))
        layout = layout_of(cfg)
        local_batch, _ = batch_sizes(cfg, comm.get_size("dp"))
        model = wrap_model(build_model(cfg, layers=layout.layers), cfg, layout)
        run = step_run(cfg, layout, model, build_optimizer(cfg, model), Phases([]), "cpu")
        inp, tar = batch(cfg, layout, local_batch)
        for _ in range(2):
            Step()(run, inp, tar)
        with CollectiveRecorder() as recorder:
            Step()(run, inp, tar)
        found[name, recompute] = counted(recorder.collectives)
        del run, model
    return found


@FAKE_STEPS
@pytest.mark.distributed
def test_the_dry_run_counts_the_collectives_of_real_jobs_exactly() -> None:
    real = run_distributed(_real_steps, RANKS, timeout=300)
    for name, recompute in CASES:
        job = PlannedJob(_config(name, recompute), RANKS, gpus_per_node=RANKS, device_type="cpu")
        for rank in range(RANKS):  # every rank, not only the roles a dry run builds
            dry = counted(job.role(rank, memory=False).trace.collectives)
            assert dry == real[rank][name, recompute] and dry, (name, recompute, rank)
            dp_group = tuple(job.generator.group_of("dp", rank))
            over_dp = Counter()
            for (op, group, _), n in dry.items():
                over_dp[op] += n if group == dp_group else 0
            if name.startswith("dp2"):  # DDP's buckets: more than one
                assert set(+over_dp) == {"all_reduce"} and over_dp["all_reduce"] >= 2, over_dp
            if name == "fsdp-dp4":  # the root and each block gathered, blocks twice
                assert +over_dp == Counter(all_gather=5, reduce_scatter=3), over_dp


@FAKE_STEPS
def test_a_job_of_1024_ranks_has_the_groups_the_rank_generator_says() -> None:
    cfg = read_config(CONFIG_FILE, "tiny", environ={}).replace(tp=4, local_batch_size=1)
    job = PlannedJob(cfg, 1024, gpus_per_node=4, device_type="cpu")
    job.check_nodes()
    assert job.partition_problems() == []
    assert job.roles() == [0, 1, 2, 3, 1020, 1023]  # every tp position, both dp ends
    start = job.startup()
    # tp (and tp-cp, mp: the same groups) and dp: 256 + 4 groups, one split each with
    # split_group, no group of one rank (cp, h, w)
    assert (start["groups"], start["splits"], start["splits_without_split_group"]) == \
        (260, 2, 260)
    for rank in (0, 1023):
        role = job.role(rank, memory=False)
        assert role.groups_ok, role.problems
        axes = {row["axis"]: row for row in job.collective_rows(role.trace.collectives)}
        assert set(axes) == {"tp", "dp"} and axes["dp"]["ranks"] == 256
        assert axes["dp"]["crosses_nodes"] and not axes["tp"]["crosses_nodes"]


def test_bad_jobs_are_refused_in_one_line(capsys: pytest.CaptureFixture) -> None:
    cfg = read_config(CONFIG_FILE, "tiny", environ={})
    with pytest.raises(UserError, match=r"--gpus 6 is not divisible by .* = 4 x 1 x 1 x 1"):
        PlannedJob(cfg.replace(tp=4), 6, 4)
    with pytest.raises(UserError, match=r"--gpus_per_node 2 splits the tp group \[0, 1, 2, 3\]"):
        PlannedJob(cfg.replace(tp=4), 8, 2).check_nodes()
    for argv, words in ((["--gpus", "6", "--tp", "4"], "--gpus 6 is not divisible"),
                        (["--gpus", "8", "--tp", "4", "--gpus_per_node", "2"],
                         "--gpus_per_node 2 splits the tp group"),
                        (["--gpus", "4", "--gpu", "v100"], "unknown --gpu 'v100'"),
                        (["--gpus", "8"], "give --local_batch_size")):
        assert dry_run.main(["--config", "tiny", *argv]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: ") and err.count("\n") == 1, err
        assert words in err, err


@FAKE_STEPS
def test_the_command_prints_one_json_object_per_rank_role(capsys: pytest.CaptureFixture
                                                           ) -> None:
    assert dry_run.main(["--config", "tiny", "--gpus", "8", "--tp", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in rows] == [0, 1, 6, 7]  # the tp positions, the dp ends
    for r in rows:
        assert JSON_KEYS <= set(r), set(r) ^ JSON_KEYS
        assert (r["dp"], r["tp"], r["groups_ok"], r["fits"]) == (4, 2, True, True)
        assert r["samples_per_s"] == pytest.approx(r["global_batch"] / max(
            x["step_s"] for x in rows))
        assert {(c["op"], c["axis"]) for c in r["collectives"]} == {
            ("all_reduce", "tp"), ("all_reduce", "dp")}


@pytest.mark.parametrize("shape,chunks,dim", [((10, 3), 4, 0), ((1, 5, 4), 8, 1), ((7,), 7, 0),
                                              ((2, 3), 5, 0), ((2, 8, 6), 3, 2)])
def test_fsdp_chunks_made_on_demand_are_torchs(shape: tuple, chunks: int, dim: int) -> None:
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    theirs, ours = _chunk_with_empty(t, chunks, dim), _Chunks(t, chunks, dim)
    assert len(ours) == len(theirs) == chunks
    for a, b in zip(theirs, ours, strict=True):
        assert (a.shape, a.stride()) == (b.shape, b.stride())
        if a.numel():
            assert a.storage_offset() == b.storage_offset() and torch.equal(a, b)


@pytest.mark.parametrize("section,gpus", [("mp", 12), ("afno", 1024)])
def test_the_dry_run_builds_fsdp_where_dp_divides_no_dim_of_a_parameter(section: str,
                                                                        gpus: int) -> None:
    cfg = read_config(CONFIG_FILE, section, environ={}).replace(fsdp=True)
    with fake_world(gpus, rank=gpus - 1, collectives=False):
        comm.init(cfg.parallel_order, **config_sizes(cfg))
        layout = Layout.of_groups(cfg, None, torch.device("cpu"))
        with fake_model(cfg, layout, "cpu") as model:
            for name, p in model.named_parameters():
                assert isinstance(p, DTensor) and p.device_mesh.size() == gpus, name
                assert p.placements[0].dim == shard_dim(p.shape, gpus), name
