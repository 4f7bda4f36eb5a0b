"""The time model (planning/time_model.py): textbook communication costs, the link classes,
how each library overlaps its collectives with the compute, and the calibration.

  - a ring collective of S bytes over p ranks sends 2 S (p-1)/p per rank (all-reduce) and
    S (p-1)/p (all-gather, reduce-scatter, all-to-all); a collective's time is those
    bytes at its group's bus bandwidth plus a latency per step, and the all-reduce takes
    the faster of ring and tree;
  - the bus bandwidth: inside a node NVLink to the group's peers there (Perlmutter's
    links per pair, an HGX node's switch), across nodes the NICs of the group's ranks on a
    node; an all-to-all across nodes goes out through each rank's own NIC;
  - the step: collectives of tensor/context/spatial parallelism are exposed; DDP's buckets
    and FSDP's reduce-scatters run behind the backward, waited for at its end; FSDP's
    all-gathers are issued one module ahead and waited for where they are read;
  - the compute factor calibrated from a step time gives that step time back; an operator
    runs at the rate of its kind and shape (planning/rates.py), at least a launch.
The dry run's traces against real jobs: tests/test_dry_run.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from planning.collectives import Collective
from planning.machines import GPUS, NETWORKS
from planning.step_trace import Compute, Phase, Wait
from planning.time_model import Placement, TimeModel, ring_bytes

S = 1e9  # bytes
MS = 1e-3


@pytest.mark.parametrize("p", [2, 4, 8, 1024])
def test_ring_collectives_send_the_textbook_bytes(p: int) -> None:
    assert ring_bytes("all_reduce", S, p) == pytest.approx(2 * S * (p - 1) / p)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert ring_bytes(op, S, p) == pytest.approx(S * (p - 1) / p)
    assert ring_bytes("all_reduce", S, 1) == 0


def _model(network: str, gpu: str = "h100") -> TimeModel:
    return TimeModel(GPUS[gpu], NETWORKS[network], link_efficiency=1.0)


def test_an_all_reduce_inside_an_hgx_node_runs_at_nvswitch_bandwidth() -> None:
    model = _model("ib-hgx")
    call = Collective("all_reduce", tuple(range(8)), int(S))
    ring = 2 * S * 7 / 8 / 450e9 + 2 * 7 * 1e-6
    tree = 2 * S / 450e9 + 2 * 3 * 1e-6
    assert model.collective_s(call) == pytest.approx(min(ring, tree)) == pytest.approx(ring)
    # tiny: latency decides, and the tree's log2(p) steps beat the ring's p - 1
    small = Collective("all_reduce", tuple(range(8)), 4)
    assert model.collective_s(small) == pytest.approx(2 * 4 / 450e9 + 6e-6)


def test_perlmutter_links_join_pairs_and_each_gpu_has_its_own_nic() -> None:
    model = _model("perlmutter", "a100-40gb")
    # tp 2 reaches one peer (100 GB/s), tp 4 three (300 GB/s)
    assert model.bandwidth(Placement.of((0, 1), 4)) == pytest.approx(100e9)
    assert model.bandwidth(Placement.of((0, 1, 2, 3), 4)) == pytest.approx(300e9)
    # a dp group of one rank per node: its NIC; of four per node: the node's four NICs
    assert model.bandwidth(Placement.of((0, 4, 8, 12), 4)) == pytest.approx(25e9)
    assert model.bandwidth(Placement.of(tuple(range(16)), 4)) == pytest.approx(100e9)
    call = Collective("all_gather", (0, 4, 8, 12), int(S))
    assert model.collective_s(call) == pytest.approx(S * 3 / 4 / 25e9 + 3 * 5e-6)
    # an all-to-all over 2 nodes of 4: 3/8 of it over NVLink, 4/8 through each NIC
    a2a = Collective("all_to_all", tuple(range(8)), int(S))
    assert model.collective_s(a2a) == pytest.approx(
        max(S * 3 / 8 / 300e9, S * 4 / 8 / 25e9) + 7 * 5e-6)
    assert Placement.of((0, 4), 4).crosses_nodes and not Placement.of((0, 3), 4).crosses_nodes


class _Fixed(TimeModel):
    """Times by hand: a Compute takes `flops` ms, a collective `nbytes` ms."""

    def __init__(self) -> None:
        super().__init__(GPUS["h100"], NETWORKS["ib-hgx"])

    def compute_s(self, op: Compute) -> float:
        return op.flops * MS

    def collective_s(self, call: Collective) -> float:
        return call.nbytes * MS


def _c(ms: float) -> Compute:
    return Compute(ms, 0.0, torch.bfloat16)


TP, DP = (0, 1), (0, 2)
AXES = {TP: "tp", DP: "dp"}


def _kind(call: Collective, axis: str, phase: str) -> str:
    """DDP on dp in backward, FSDP's all-gathers on dp in forward, tp exposed."""
    if axis == "dp":
        return "behind" if phase == "backward" else "prefetch"
    return "wait"


def test_ddp_buckets_hide_behind_the_backward_and_tp_waits() -> None:
    first, last = Collective("all_reduce", DP, 2), Collective("all_reduce", DP, 2)
    events = [Phase("forward"), _c(4), Collective("all_reduce", TP, 1), _c(4),
              Phase("backward"), _c(5), first, _c(5), last, Phase("after backward"),
              Phase("optimizer"), _c(1)]
    split = _Fixed().step(events, AXES, _kind)
    # tp: 1 ms exposed; the first bucket runs under the second half of backward, the last
    # (issued at backward's end) is waited for: 2 ms
    assert split.exposed == pytest.approx({"tp": 1.0 * MS, "dp": 2.0 * MS})
    assert split.compute_s == pytest.approx(19 * MS)
    assert split.step_s == pytest.approx(22 * MS)
    assert split.busy == pytest.approx({"tp": 1 * MS, "dp": 4 * MS})


def test_fsdp_gathers_one_module_ahead() -> None:
    gathers = [Collective("all_gather", DP, 1) for _ in range(3)]
    events = [Phase("forward")]
    for ag in gathers:  # each block's gather before it, read by its first operator
        events += [ag, Wait(ag), _c(5)]
    split = _Fixed().step(events, AXES, _kind)
    # the first gather is exposed (nothing to hide behind); each next one starts with the
    # block before it and is done when that block ends
    assert split.exposed == pytest.approx({"dp": 1 * MS})
    assert split.step_s == pytest.approx(16 * MS)
    slow = [Collective("all_gather", DP, 7) for _ in range(3)]
    events = [Phase("forward")]
    for ag in slow:
        events += [ag, Wait(ag), _c(5)]
    # 7 ms gathers behind 5 ms blocks: the link is the bottleneck, 7 + 7 + 7 + 5
    assert _Fixed().step(events, AXES, _kind).step_s == pytest.approx(26 * MS)


def test_the_calibrated_compute_factor_gives_the_measured_step_back() -> None:
    events = [Phase("forward"), Compute(2e12, 1e9, torch.bfloat16, "gemm"),
              Collective("all_reduce", TP, 10_000_000), Compute(0, 5e9, None)]
    model = TimeModel(GPUS["a100-40gb"], NETWORKS["perlmutter"])

    def step_at(factor: float) -> float:
        return model.with_compute_factor(factor).step(events, AXES, _kind).step_s

    measured = 16 / step_at(1.37)  # samples/s of a step of 16 samples at factor 1.37
    assert model.calibrate(measured, 16, step_at) == pytest.approx(1.37, rel=1e-6)
    with pytest.raises(ValueError, match="faster than this model allows"):
        model.calibrate(16 / step_at(0.01), 16, step_at)
    with pytest.raises(ValueError, match="the data loader"):
        model.calibrate(16 / step_at(100), 16, step_at)


def test_each_operator_runs_at_the_rate_of_its_kind_and_shape() -> None:
    model = TimeModel(GPUS["a100-40gb"], NETWORKS["perlmutter"])
    rates = model.rates
    gemm = Compute(128e9, 1e6, torch.bfloat16, "gemm")
    assert model.compute_s(gemm) == pytest.approx(128e9 / rates.gemm("bf16", 128e9))
    # the same FLOPs in fp32 run as TF32: half the peak
    assert model.compute_s(Compute(128e9, 1e6, torch.float32, "gemm")) == \
        pytest.approx(2 * model.compute_s(gemm))
    # head dim 48 runs the head-dim-64 kernel: its FLOPs cost 64 / 48 of theirs
    att48 = Compute(1e12, 1e6, torch.bfloat16, "attention", (128, 4050, 4050, 48))
    att64 = Compute(1e12, 1e6, torch.bfloat16, "attention", (128, 4050, 4050, 64))
    assert model.compute_s(att48) == pytest.approx(model.compute_s(att64) * 64 / 48)
    # elementwise: its bytes at the memory rate of its size; a tiny one: a launch
    add = Compute(0, 3e8, None)
    assert model.compute_s(add) == pytest.approx(3e8 / rates.memory(3e8))
    assert model.compute_s(Compute(0, 16, None)) == pytest.approx(rates.launch_s)
    assert model.compute_s(Compute(0, 0, None)) == 0.0  # metadata: no kernel
    # a factor multiplies every operator's time
    assert model.with_compute_factor(2.0).compute_s(gemm) == \
        pytest.approx(2 * model.compute_s(gemm))
    assert math.isclose(model.compute_s(Compute(0, 1e9, None)), 1e9 / rates.memory(1e9))
