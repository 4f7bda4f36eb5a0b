"""utils/openmp.py: the OpenMP wait policy is chosen by what shares the cores, before torch
loads, and a user's own setting wins."""

from __future__ import annotations

import pytest

from utils import openmp
from utils.openmp import SLEEP, SPIN, choose, choose_before_torch


def test_training_threads_alone_on_their_cores_spin():
    policy = choose(0, "pytorch", environ={}, cores=2)
    assert policy.env == SPIN
    assert "2 training threads have 2 cores to themselves" in policy.why


def test_other_busy_processes_or_dali_threads_make_idle_threads_sleep():
    busy = choose(0, "pytorch", environ={}, cores=2, busy=1)
    assert busy.env == SLEEP and "1 busy thread of other processes share" in busy.why
    spare = choose(0, "pytorch", environ={"OMP_NUM_THREADS": "2"}, cores=8, busy=3)
    assert spare.env == SPIN  # 2 threads + 3 busy ones fit on 8 cores
    dali = choose(2, "dali", environ={}, cores=8)
    assert dali.env == SLEEP and "DALI's pipeline threads share" in dali.why


def test_loader_workers_alone_do_not_stop_the_spinning():
    """One worker on 2 cores: the spinning step measured faster (docs/benchmarks.md)."""
    policy = choose(1, "pytorch", environ={}, cores=2)
    assert policy.env == SPIN and "(1 loader worker aside)" in policy.why


def test_more_threads_than_cores_sleep_and_one_thread_needs_nothing():
    crowded = choose(0, "pytorch", environ={"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "2"},
                     cores=2)
    assert crowded.env == SLEEP and "2 ranks x 2 threads on 2 cores" in crowded.why
    # torchrun's ranks on a 2-core machine get one thread each: no pool waits
    single = choose(0, "pytorch", environ={"LOCAL_WORLD_SIZE": "2"}, cores=2)
    assert single.env == {} and "one OpenMP thread" in single.why


@pytest.mark.parametrize("key", ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT"])
def test_a_users_own_setting_wins(key):
    policy = choose(2, "pytorch", environ={key: "ACTIVE" if "POLICY" in key else "5000"},
                    cores=2)
    assert policy.env == {} and "set by you" in policy.why and key in policy.why


def test_choose_before_torch_reads_the_config_of_the_command_line(monkeypatch):
    monkeypatch.setattr(openmp, "_chosen", None)
    monkeypatch.setattr(openmp, "available_cores", lambda: 2)
    monkeypatch.setattr(openmp, "busy_elsewhere", lambda: 0)
    env: dict[str, str] = {}
    policy = choose_before_torch(["--config", "tiny", "--data_loader_config", "dali"],
                                 environ=env)
    assert env == SLEEP and policy.env == SLEEP
    assert openmp.describe().startswith("OpenMP wait policy: OMP_WAIT_POLICY=PASSIVE")
    env = {}
    policy = choose_before_torch(["--config", "tiny", "--table", "--iters", "3"], environ=env)
    assert env == SPIN and "have 2 cores to themselves" in policy.why  # --table: not ours


def test_busy_threads_elsewhere_are_read_from_the_kernel():
    assert openmp.busy_elsewhere(samples=2, interval=0.0) >= 0


@pytest.mark.parametrize("argv", [["--help"], ["--config", "no_such_config"],
                                  ["--num_data_workers", "many"]])
def test_a_command_line_that_does_not_parse_is_left_to_the_script(argv, monkeypatch):
    monkeypatch.setattr(openmp, "_chosen", None)
    env: dict[str, str] = {}
    assert choose_before_torch(argv, environ=env).env == {} and env == {}


def test_the_policy_counts_threads_as_the_ranks_get_them():
    """One rule for threads per process (`threads_per_process`, which distributed.comm sets
    torch's threads from): a SLURM task of one CPU has no pool that waits."""
    environ = {"SLURM_CPUS_PER_TASK": "1"}
    assert openmp.threads_per_process(environ, ranks_per_node=1, cores=8) == 1
    assert choose(0, "pytorch", environ=environ, cores=8).env == {}
    assert openmp.threads_per_process({}, ranks_per_node=4, cores=8) == 2
