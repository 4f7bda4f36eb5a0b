"""Process-group layout: distributed.rank_generator (pure) and distributed.comm (real processes).

Every group `comm.init` makes waits as long as the job says (DIST_TIMEOUT_SEC), not its
backend's default: on gloo, read back from each real group; on NCCL, where this PyTorch
build has it, the arguments of each communicator split (`comm.split_arguments`).
"""

from __future__ import annotations

import gc
import inspect
import itertools
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import run_distributed
from torch.nn.parallel import DistributedDataParallel

from distributed import comm
from distributed.rank_generator import RankGenerator

ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "cp", "dp"))]
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 3), (2, 2, 2), (4, 2, 1), (2, 3, 2), (1, 1, 4)]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("tp,cp,dp", LAYOUTS)
def test_groups_partition_and_are_orthogonal(tp: int, cp: int, dp: int, order: str) -> None:
    gen = RankGenerator({"tp": tp, "cp": cp, "dp": dp}, order)
    world = range(tp * cp * dp)
    for name, size in [("tp", tp), ("cp", cp), ("dp", dp), ("tp-cp", tp * cp)]:
        groups = gen.get_ranks(name)
        assert sorted(r for g in groups for r in g) == list(world), name  # a partition
        assert all(len(g) == size for g in groups), name
    for r in world:
        tp_g, cp_g, dp_g = (set(gen.group_of(n, r)) for n in ("tp", "cp", "dp"))
        # any two single-axis groups through r meet only in r
        assert tp_g & cp_g == tp_g & dp_g == cp_g & dp_g == {r}
        # the model-parallel group is every (tp, cp) combination with r's dp coordinate
        assert set(gen.group_of("tp-cp", r)) == {t for c in cp_g for t in gen.group_of("tp", c)}
        assert gen.rank(gen.coords(r)) == r


def test_documented_order() -> None:
    # default "tp-cp-dp": tp fastest, so tensor-parallel partners are adjacent ranks
    gen = RankGenerator({"tp": 2, "cp": 2, "dp": 2})
    assert gen.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gen.get_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert gen.get_ranks("tp-cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert gen.coords(6) == {"tp": 0, "cp": 1, "h": 0, "w": 0, "ens": 0, "dp": 1}
    # "dp-tp-cp": dp fastest, then tp, then cp
    gen = RankGenerator({"tp": 2, "cp": 2, "dp": 2}, "dp-tp-cp")
    assert gen.get_ranks("dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gen.get_ranks("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_bad_layouts() -> None:
    with pytest.raises(ValueError, match="order"):
        RankGenerator({"cp": 2}, "tp-dp")  # cp has size 2 but is not placed
    with pytest.raises(ValueError, match="axis"):
        RankGenerator({"tp": 2}, "tp-cp-xx")
    with pytest.raises(ValueError, match="positive"):
        RankGenerator({"tp": 0})
    with pytest.raises(ValueError, match="unknown axis pp"):
        RankGenerator({"pp": 2})


def test_without_torch_distributed() -> None:
    assert not dist.is_initialized()
    comm.reset()
    for name in ("tp", "cp", "dp", "tp-cp"):
        assert (comm.get_size(name), comm.get_rank(name), comm.get_group(name)) == (1, 0, None)
    assert (comm.get_world_size(), comm.get_world_rank(), comm.is_distributed()) == (1, 0, False)
    comm.init(tp=1, cp=1)
    assert comm.get_size("tp-cp") == 1 and comm.get_group("dp") is None
    with pytest.raises(ValueError, match=r"world size 1 .* tp x cp x h x w x ens = 2 x 1 x 1"):
        comm.init(tp=2, cp=1)
    with pytest.raises(KeyError, match="unknown process group"):
        comm.get_size("pp")
    with pytest.raises(TypeError, match=r"sizes of pp; the axes with a size are \('tp'"):
        comm.init(pp=2)
    comm.reset()


def _check_layouts(layouts: list[tuple[int, int, str]]) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    # before init: tp = cp = 1 and dp is the whole world
    assert (comm.get_size("dp"), comm.get_rank("dp"), comm.get_size("tp-cp")) == (world, rank, 1)
    for tp, cp, order in layouts:
        comm.init(tp=tp, cp=cp, order=order)
        gen = RankGenerator({"tp": tp, "cp": cp, "dp": world // (tp * cp)}, order)
        for name in ("tp", "cp", "dp", "tp-cp"):
            expected = gen.group_of(name, rank)
            assert comm.get_size(name) == len(expected) == gen.group_size(name)
            assert comm.get_rank(name) == expected.index(rank)
            if len(expected) == 1:  # no process group of one rank (None would be the world)
                with pytest.raises(ValueError, match=f"group '{name}' has one rank"):
                    comm.get_group(name)
                continue
            # the real group's members, in group-rank order, are the documented ranks
            members = [torch.zeros(1, dtype=torch.int64) for _ in expected]
            dist.all_gather(members, torch.tensor([rank]), group=comm.get_group(name))
            assert [int(m) for m in members] == expected, (name, tp, cp, order)
    bad = 3 if world % 3 else 5
    try:
        comm.init(tp=bad, cp=1)
    except ValueError as e:
        assert f"world size {world}" in str(e) and f"{bad} x 1 x 1 x 1" in str(e)
    else:
        raise AssertionError("indivisible layout accepted")


@pytest.mark.distributed
def test_groups_on_4_processes() -> None:
    layouts = [(1, 1, "tp-cp-dp"), (2, 1, "tp-cp-dp"), (1, 2, "tp-cp-dp"), (2, 2, "tp-cp-dp"),
               (4, 1, "tp-cp-dp"), (2, 1, "dp-cp-tp"), (1, 2, "cp-dp-tp"), (2, 2, "cp-tp-dp")]
    run_distributed(_check_layouts, 4, layouts)


@pytest.mark.distributed
def test_groups_on_8_processes() -> None:
    layouts = [(2, 2, "tp-cp-dp"), (2, 2, "dp-tp-cp"), (4, 2, "cp-tp-dp"), (2, 4, "tp-dp-cp"),
               (8, 1, "tp-cp-dp"), (1, 2, "dp-cp-tp")]
    run_distributed(_check_layouts, 8, layouts)



def _timeouts_of_every_group() -> dict[str, float]:
    """Seconds each group of a tp 2 x dp 2 layout waits, read back from its gloo backend,
    the job's collective timeout set to 7 s (this rank's environment: a forked process)."""
    os.environ["DIST_TIMEOUT_SEC"] = "7"
    comm.init(tp=2)  # two partitions of the 4 ranks: the tp groups, then the dp groups
    backend_of = {name: comm.get_group(name)._get_backend(torch.device("cpu"))
                  for name in ("tp", "dp")}
    waits = {name: b.options._timeout.total_seconds() for name, b in backend_of.items()}
    waits["world"] = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout \
        .total_seconds()
    return waits


@pytest.mark.distributed
def test_every_group_waits_as_long_as_the_job_says() -> None:
    # gloo's default would be 30 minutes; the world here is the test harness's (60 s)
    assert run_distributed(_timeouts_of_every_group, 4) == [{"tp": 7.0, "dp": 7.0,
                                                             "world": 60.0}] * 4


@pytest.mark.skipif(not hasattr(dist, "ProcessGroupNCCL"),
                    reason=f"PyTorch {torch.__version__} is built without NCCL: no NCCL "
                    "options to construct")
def test_each_nccl_split_gets_options_of_its_own_with_the_jobs_timeout() -> None:
    """What `dist.split_group` receives for each partition (`comm.split_arguments`): the
    timeout, and a new options object. 2.7 and 2.8 write each split's timeout, colour and
    rank list into the options they are given, 2.9's C++ split too; given none, into the
    world's own (`split_arguments` says what that broke)."""
    timeout = timedelta(seconds=7)
    first, second = comm.split_arguments(timeout), comm.split_arguments(timeout)
    for arguments in (first, second):
        options = arguments["pg_options"]
        assert arguments["timeout"] == options._timeout == timeout
        assert isinstance(options, dist.ProcessGroupNCCL.Options)  # as 2.7's split_group asks
        assert (options.global_ranks_in_group, options.split_from) == ([], None)
        # this PyTorch's split_group takes them
        inspect.signature(dist.split_group).bind(split_ranks=[[0, 1], [2, 3]], **arguments)
    assert first["pg_options"] is not second["pg_options"]
    first["pg_options"].global_ranks_in_group = [0, 1]  # what the first split writes...
    first["pg_options"]._timeout = timedelta(minutes=10)
    assert second["pg_options"].global_ranks_in_group == []  # ...the second never reads
    assert second["pg_options"]._timeout == timeout


def _groups_and_a_ddp_step() -> DistributedDataParallel:
    comm.init(tp=2)  # tp = 2, dp = 2 on 4 ranks
    model = DistributedDataParallel(torch.nn.Linear(4, 4), process_group=comm.get_group("dp"))
    model(torch.ones(2, 4)).sum().backward()  # DDP's all-reduce on the dp group
    return model


def _shutdown_joins_every_communication_thread() -> tuple[int, int, int]:
    """Groups, a DDP step and a tp all-reduce; then destroy_process_group() while a group is
    still held (what shutdown avoids); then release it."""
    model = _groups_and_a_ddp_step()
    t = torch.ones(3)
    dist.all_reduce(t, group=comm.get_group("tp"))
    running = comm.gloo_threads()
    held = comm.get_group("tp")
    del model
    comm.reset()
    dist.destroy_process_group()
    after_destroy_while_held = comm.gloo_threads()
    del held
    gc.collect()
    return running, after_destroy_while_held, comm.gloo_threads()


def _shutdown_after_a_ddp_step() -> int:
    _groups_and_a_ddp_step()  # the model it returns is dropped at once
    comm.shutdown()
    return comm.gloo_threads()


@pytest.mark.distributed
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_shutdown_leaves_no_communication_thread_to_outlive_the_interpreter() -> None:
    """A gloo thread alive at interpreter exit can abort a finished run (exit -6); after
    comm.shutdown() none is left, also after DDP (whose import of torch._dynamo would
    otherwise bind the world group as a default argument)."""
    counts = run_distributed(_shutdown_joins_every_communication_thread, 4)
    if not any(running for running, _, _ in counts):
        pytest.skip(f"PyTorch {torch.__version__} does not name gloo's threads "
                    f"{comm.GLOO_THREAD_NAMES}: nothing to count")  # PyTorch 2.7
    for running, while_held, released in counts:
        assert running > while_held > released == 0  # a held group keeps its threads
    assert run_distributed(_shutdown_after_a_ddp_step, 4) == [0, 0, 0, 0]


def test_spatial_mesh_groups() -> None:
    # tp=1 cp=1, h=2 x w=2 x dp=2 in the default order: h fastest, then w, then dp
    gen = RankGenerator({"h": 2, "w": 2, "dp": 2})
    assert gen.get_ranks("h") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gen.get_ranks("w") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("h-w") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert gen.get_ranks("tp-cp-h-w") == gen.get_ranks("h-w") == gen.get_ranks("mp")
    assert gen.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="order"):
        RankGenerator({"h": 2}, "tp-cp-dp")  # h has size 2 but is not placed


def test_start_up_makes_each_partition_of_the_world_once_and_no_group_of_one_rank() -> None:
    # tp 4 x dp 256 (1,024 ranks): "tp-cp", "mp" and "mp-ens" are the tp groups, cp, h, w
    # and ens have one rank each: two partitions, each made at once (on NCCL one
    # communicator split each)
    parts = RankGenerator({"tp": 4, "dp": 256}).partitions()
    assert [names for names, _ in parts] == [("tp", "tp-cp", "mp", "mp-ens"), ("dp",)]
    assert [(len(groups), len(groups[0])) for _, groups in parts] == [(256, 4), (4, 256)]
    gen = RankGenerator({"h": 2, "w": 2, "dp": 2})
    assert {names: groups for names, groups in gen.partitions()} == {
        ("h",): gen.get_ranks("h"), ("w",): gen.get_ranks("w"), ("dp",): gen.get_ranks("dp"),
        ("h-w", "mp", "mp-ens"): gen.get_ranks("mp")}
    # an ensemble's members over ens: "ens" its own partition, "mp-ens" the tp and ens ranks
    gen = RankGenerator({"tp": 2, "ens": 2, "dp": 2}, "tp-ens-dp")
    assert [names for names, _ in gen.partitions()] == [("tp", "tp-cp", "mp"), ("ens",),
                                                        ("dp",), ("mp-ens",)]
    assert gen.get_ranks("mp-ens") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert RankGenerator({"dp": 8}).partitions() == [(("dp",), [list(range(8))])]
    assert RankGenerator({"dp": 1}).partitions() == []
