"""distributed.mappings and the collectives under them: forward and backward of every function
against the analytic result, including uneven splits (7 over 2 and 3 ranks, 5 over 4)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import run_distributed

from distributed import comm
from distributed import mappings as m
from distributed.helpers import compute_split_shapes

# (shape, dim): the split dim has uneven lengths for 2, 3 and 4 ranks in most cases
CASES = [((2, 7, 3), 1), ((3, 2, 5), -1), ((7, 4), 0), ((2, 8, 3), 1)]


def test_compute_split_shapes() -> None:
    assert compute_split_shapes(4050, 4) == [1013, 1013, 1012, 1012]
    assert compute_split_shapes(7, 2) == [4, 3]
    assert compute_split_shapes(8, 4) == [2, 2, 2, 2]
    assert compute_split_shapes(5, 5) == [1] * 5
    for size in range(1, 40):
        for n in range(1, size + 1):
            s = compute_split_shapes(size, n)
            assert sum(s) == size and max(s) - min(s) <= 1 and s == sorted(s, reverse=True)
    with pytest.raises(ValueError, match="cannot split 3 elements into 4"):
        compute_split_shapes(3, 4)


def test_size_one_groups_are_identity() -> None:
    comm.reset()
    x = torch.randn(2, 5, requires_grad=True)
    for f in (m.copy_to_parallel_region, m.reduce_from_parallel_region):
        assert f(x, "tp") is x
    for f in (m.scatter_to_parallel_region, m.gather_from_parallel_region):
        assert f(x, 1, "cp") is x
    assert m.gather_from_parallel_region(x, 1, "cp", backward="reduce_scatter") is x
    with pytest.raises(ValueError, match="backward must be"):
        m.gather_from_parallel_region(x, 1, "cp", backward="sum")


def _data(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check_case(shape: tuple[int, ...], dim: int, group: str) -> None:
    n, r = comm.get_size(group), comm.get_rank(group)
    sizes = compute_split_shapes(shape[dim], n)
    chunk = lambda t: torch.split(t, sizes, dim=dim)[r]  # this rank's chunk
    d = dim % len(shape)
    full = [_data(100 + k, shape) for k in range(n)]  # rank k's full-size tensor
    part = [_data(200 + k, shape[:d] + (sizes[k],) + shape[d + 1:])
            for k in range(n)]  # rank k's chunk
    close = torch.testing.assert_close

    # copy_to: identity / all-reduce
    x = full[0].clone().requires_grad_()
    y = m.copy_to_parallel_region(x, group)
    close(y, full[0])
    y.backward(full[r])
    close(x.grad, sum(full))

    # reduce_from: all-reduce / identity
    x = full[r].clone().requires_grad_()
    y = m.reduce_from_parallel_region(x, group)
    close(y, sum(full))
    y.backward(full[0])
    close(x.grad, full[0])

    # scatter_to: my chunk / all-gather
    x = full[0].clone().requires_grad_()
    y = m.scatter_to_parallel_region(x, dim, group)
    close(y, chunk(full[0]))
    y.backward(part[r])
    close(x.grad, torch.cat(part, dim))

    # gather_from (lengths given and exchanged): all-gather / my chunk
    for given in (sizes, None):
        x = part[r].clone().requires_grad_()
        y = m.gather_from_parallel_region(x, dim, group, given)
        close(y, torch.cat(part, dim))
        y.backward(full[r])
        close(x.grad, chunk(full[r]))

    # gather_from, backward="reduce_scatter": all-gather / reduce-scatter (sum)
    x = part[r].clone().requires_grad_()
    y = m.gather_from_parallel_region(x, dim, group, sizes, backward="reduce_scatter")
    close(y, torch.cat(part, dim))
    y.backward(full[r])
    close(x.grad, chunk(sum(full)))


def _check_all(layouts: list[tuple[int, int, str]]) -> None:
    for tp, cp, group in layouts:
        comm.init(tp=tp, cp=cp)
        for shape, dim in CASES:
            if shape[dim] >= comm.get_size(group):
                _check_case(shape, dim, group)
    dist.barrier()


@pytest.mark.distributed
def test_mappings_on_2_processes() -> None:
    run_distributed(_check_all, 2, [(2, 1, "tp"), (1, 2, "cp"), (2, 1, "tp-cp")])


@pytest.mark.distributed
def test_mappings_on_3_processes() -> None:
    run_distributed(_check_all, 3, [(3, 1, "tp"), (1, 3, "cp")])


@pytest.mark.distributed
def test_mappings_on_4_processes_and_subgroups() -> None:
    # (2, 2): the tp and cp groups are proper subgroups; (1, 4): 5 tokens over 4 ranks
    run_distributed(_check_all, 4, [(2, 2, "tp"), (2, 2, "cp"), (2, 2, "tp-cp"), (1, 4, "cp")])
