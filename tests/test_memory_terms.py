"""The planner's terms beyond the traced tensors (planning/memory_terms.py) and the published
figures they are set against (planning/published_memory.py), without tracing: the caching
allocator's rule against the requests the tutorial's runs failed on, every term named with
its source, NCCL's buffers growing with a layout's communicators, DALI's with the batch, the
measured-terms file, and the gpu-check's report of what it measured. The traced comparison
with the published runs is tests/test_memory_plan.py's (end to end)."""

from __future__ import annotations

import json

import pytest

from planning import memory_terms as mt
from planning import published_memory as pub
from tools.gpu_check.memory import calibration
from tools.gpu_check.report import Line
from utils.errors import UserError

TOKENS, EMBED = (360 // 8) * (720 // 8), 1024
BATCH, CHANNELS, PIXELS = 16, 20, 360 * 720


@pytest.mark.parametrize("what, nbytes", [
    ("an fp32 field batch (16, 20, 360, 720): the loss's gradient, SC23", BATCH * CHANNELS
     * PIXELS * 4),
    ("an fp32 LayerNorm output (16, 4050, 1024) under autocast, SC24", BATCH * TOKENS * EMBED
     * 4),
    ("an fp16 MLP hidden activation (16, 4050, 4096), SC25", BATCH * TOKENS * 4 * EMBED * 2),
], ids=["SC23", "SC24", "SC25"])
def test_the_allocator_rule_gives_the_requests_the_published_runs_failed_on(what, nbytes):
    edition = what.rsplit(" ", 1)[-1]
    oom = next(p for p in pub.PUBLISHED if p.kind == "oom" and p.edition == edition)
    assert mt.segment_bytes(nbytes) == oom.requested_mib * mt.MIB, what


def test_a_block_keeps_its_segment_whole_unless_over_1_mib_is_left_to_split_off():
    assert mt.block_bytes(1) == mt.block_bytes(512) == 512
    assert mt.block_bytes(513) == 1024
    lnorm = BATCH * TOKENS * EMBED * 4  # 253.1 MiB: 0.9 MiB short of its 254 MiB segment
    assert mt.block_bytes(lnorm) == 254 * mt.MIB
    hidden = BATCH * TOKENS * 4 * EMBED * 2  # 506.25 MiB: 1.75 MiB left, split off
    assert mt.block_bytes(hidden) == hidden
    assert mt.segment_bytes(3 * mt.MIB) == 20 * mt.MIB  # under 10 MiB: a 20 MiB segment


def test_every_term_is_named_with_its_source():
    work = mt.Workload.of("dali", BATCH, 2 * CHANNELS, (360, 720), [(0, 1, 2, 3)])
    terms = mt.beyond_tensors(31 * mt.GIB, 0.03 * mt.GIB, work)
    assert tuple(terms) == mt.NAMES
    assert set(mt.NAMES) | {"usable memory"} == set(mt.SOURCES)
    assert all(len(mt.SOURCES[name]) > 40 for name in mt.SOURCES)
    assert all(value > 0 for value in terms.values()), terms
    inside = sum(terms[n] for n in mt.INSIDE)
    assert terms["fragmentation"] == pytest.approx(
        mt.MemoryTerms().fragmentation * (31 + terms["allocator rounding"]
                                          + terms["cuBLAS workspaces"]))
    assert inside < sum(terms[n] for n in mt.OUTSIDE)  # DALI's buffers dominate at batch 16


@pytest.mark.parametrize("sizes, count", [
    ({"dp": 4}, 1),                      # the world is the dp group
    ({"tp": 4, "dp": 4}, 3),             # world, tp, dp
    ({"tp": 2, "cp": 2, "dp": 4}, 5),    # world, tp, cp, tp-cp (= mp), dp
    ({"tp": 4}, 1),                      # tp is the world
], ids=["dp4", "tp4xdp4", "tp2xcp2xdp4", "tp4"])
def test_nccl_buffers_grow_with_the_communicators_a_rank_is_in(sizes, count):
    comms = mt.communicators(sizes, "tp-cp-dp", rank=0)
    assert len(comms) == count and all(0 in g and len(g) > 1 for g in comms), comms
    work = mt.Workload.of("pytorch", 1, 2, (8, 8), comms)
    nccl = mt.beyond_tensors(0, 0, work)["NCCL buffers"]
    assert nccl == pytest.approx(count * 4 * 2 * 10 / 1024)  # channels x connections x 10 MiB
    measured = mt.MemoryTerms(nccl_communicator_mib=300.0)
    assert mt.nccl_gib(count, measured) == pytest.approx(count * 300 / 1024)


def test_dali_buffers_hold_the_prefetch_queue_in_every_gpu_output_of_both_pipelines():
    batch = BATCH * 2 * CHANNELS * PIXELS * 4
    ours = mt.beyond_tensors(0, 0, mt.Workload.of("dali", BATCH, 2 * CHANNELS, (360, 720), []))
    assert ours["DALI buffers"] == pytest.approx(2 * 2 * 3 * batch / mt.GIB)  # 7.42 GiB
    tutorial = mt.dali_gib(batch, mt.MemoryTerms(dali_outputs_per_tensor=2))
    assert tutorial == pytest.approx(4.94, abs=0.01)
    without = mt.Workload.of("pytorch", BATCH, 2 * CHANNELS, (360, 720), [])
    assert mt.beyond_tensors(0, 0, without)["DALI buffers"] == 0


def _tp1_row() -> dict:
    """What planning/layouts.py's row of mp at tp 1 x dp 4 holds that the comparison reads
    (the traced tensors: 31.0 GiB, tests/test_memory_plan.py traces them)."""
    work = mt.Workload.of("dali", BATCH, 2 * CHANNELS, (360, 720), [(0, 1, 2, 3)])
    terms = mt.beyond_tensors(31.02 * mt.GIB, 0.03 * mt.GIB, work)
    allocated = 31.02 + terms["allocator rounding"] + terms["cuBLAS workspaces"]
    return {"tp": 1, "local_batch": BATCH, "terms_gb": terms, "allocated_gb": allocated,
            "peak_gb": 31.02 + sum(terms.values())}


def test_the_kernels_default_is_what_sc25_held_outside_the_allocator_less_the_other_terms():
    oom = pub.CALIBRATION
    assert (oom.edition, oom.kind) == ("SC25", "oom")
    assert pub.outside_allocator(oom) == pytest.approx(6.56, abs=0.01)
    fitted = pub.calibrated(oom, _tp1_row())
    assert fitted.kernels_gib == pytest.approx(mt.MemoryTerms().kernels_gib, abs=0.01)
    assert pub.outside_allocator(next(p for p in pub.PUBLISHED if p.edition == "SC24")) == \
        pytest.approx(7.73, abs=0.01)  # SC24's software held 1.2 GiB more outside


def test_a_memory_terms_file_round_trips_and_a_bad_one_is_one_line(tmp_path):
    path = tmp_path / "memory_terms.json"
    measured = mt.MemoryTerms(context_gib=0.52, kernels_gib=0.9, measured="H200, here")
    measured.save(path)
    assert mt.MemoryTerms.load(path) == measured
    assert mt.MemoryTerms.load(None) == mt.MemoryTerms()
    path.write_text(json.dumps({"context": 1}))
    with pytest.raises(UserError, match=r"unknown keys context; expected some of"):
        mt.MemoryTerms.load(path)
    path.write_text("{")
    with pytest.raises(UserError, match="cannot read it as JSON"):
        mt.MemoryTerms.load(path)


def test_usable_memory_is_cudas_total_and_nvml_adds_the_drivers_reserve():
    assert mt.usable_gib(40) == pytest.approx(39.39)
    assert mt.driver_reserve_gib(40) == pytest.approx(0.61)
    assert mt.usable_gib(80) + mt.driver_reserve_gib(80) == pytest.approx(80)


def test_the_gpu_checks_report_gives_the_measured_terms_and_the_line_to_paste():
    assert calibration([])[-1] == "Not measured here: it needs a GPU."
    measured = {"context_gib": 0.52, "kernels_gib": 0.93, "cublas_workspace_mib": 32.0}
    line = Line("memory", "terms beyond the tensors", "info", "",
                data={"measured": measured, "path": "logs/work/memory_terms.json"})
    slack = Line("memory", "mp, tp 1", "ok", data={"slack_fraction": 0.08})
    md = "\n".join(calibration([slack, line]))
    assert "| context_gib | 0.4 | 0.52 |" in md and "| 0.045 | 0.08 |" in md
    assert "--memory_terms logs/work/memory_terms.json" in md
    assert json.dumps({k: round(v, 4) for k, v in measured.items()}) in md
