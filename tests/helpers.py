"""What the test modules share, apart from fixtures (those are in conftest.py).

    from helpers import run_distributed, assert_close_rel   # several ranks, one tolerance
    from helpers import run_script, assert_completed          # a train script, as a user runs it

Processes: `run_distributed` (N gloo ranks running a function), `child_env` and `run_script`
(a script as a subprocess, optionally under torchrun), SLURM (`start_slurm_cluster`,
`slurm_job_output`). Each of them first checks that the running test carries the marker of
its tier (`distributed`, `e2e`, `slurm`): `make test-fast` runs only unmarked tests, so a test
that starts processes without saying so fails at once instead of slowing the fast tier down.

Checks: `one_line` (a user-facing message is one line), `assert_close_rel` (tensors equal up
to a tolerance relative to the reference's largest entry), `assert_completed` (a run
finished), `losses` / `epoch_losses` (what a run logged), `final_checkpoint`,
`assert_same_state` (bitwise) and `assert_same_training` (two runs are the same training).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
CONFIG_FILE = REPO / "config" / "ViT.yaml"

# The tiny data set: 16x32 grid (the `tiny` config's img_size), 24 samples per "year".
TINY_IMG_SIZE = (16, 32)
TINY_SAMPLES_PER_YEAR = 24
TINY_YEARS = {"train": 2, "valid": 1, "test": 1}
# The tiny config's training: 16 iterations = 2 epochs of 8 (limit_nsamples 32, batch 4).
TINY_ITERS = 16
TINY_ITERS_PER_EPOCH = 8
# conftest's `reference_run`: the uninterrupted tiny run the parallel, resumed and preempted
# runs are compared with. `--resume` with no checkpoint yet starts from scratch (and says
# so), and checkpoints do not change the math.
REFERENCE_ARGS = ("--config=tiny", f"--num_iters={TINY_ITERS}", "--checkpoint_interval=4",
                  "--resume")

# What a train script logs at the end of each epoch.
EPOCH_LINES = ("Time taken for epoch", "Avg train loss=", "Avg val loss=",
               "Total validation time:")

# Variables a launcher sets; stripped from a child's environment so that a test started
# inside some job (or by torchrun) never joins it by accident.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
_LAUNCHER_PREFIXES = ("OMPI_COMM_WORLD_", "PMI_", "SLURM_")


# ----------------------------------------------------------------- tiers

# (test id, its marker names) while a test runs; set by conftest.py, None outside pytest.
running_test: tuple[str, set[str]] | None = None


def require_marker(what: str, *markers: str) -> None:
    """Fail the running test unless it carries one of `markers` (the tier that pays for
    `what`). Called before anything is started."""
    if running_test is None:
        return
    nodeid, have = running_test
    if not have & set(markers):
        wanted = " or ".join(f"@pytest.mark.{m}" for m in markers)
        pytest.fail(f"{nodeid} {what}: mark it {wanted} (tests/README.md: Tiers)", pytrace=False)


# ----------------------------------------------------------------- subprocesses

def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TrainRun:
    returncode: int
    stdout: str
    stderr: str
    log_dir: Path
    data_dir: Path
    cmd: list[str]

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def __iter__(self) -> Iterator:
        """`rc, out = run_train(...)`."""
        return iter((self.returncode, self.output))

    def exp_dir(self, config: str = "tiny", world_size: int = 1, run_num: str | None = None,
                kind: str = "CPU") -> Path:
        """<LOG_DIR>/<config>/<N><CPU|GPU>/<run_num>, where train.py writes its run. Without
        `run_num`: the directory this run's log names (a run prints it at start), else the
        only run there."""
        parent = self.log_dir / config / f"{world_size}{kind}"
        if run_num is not None:
            return parent / run_num
        named = re.findall(rf"Run directory ({re.escape(str(parent))}/[^ /\n]+) \(",
                           self.output)
        if named:
            return Path(named[-1])
        runs = sorted(p for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []
        assert len(runs) == 1, f"which run of {parent}? {[r.name for r in runs]}"
        return runs[0]


def child_env(env_extra: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The environment of a Python child running the project's code (e2e tests only)."""
    require_marker("starts a Python subprocess", "e2e", "gpu")
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_PREFIXES)}
    # Tests share a couple of cores: one thread per process avoids oversubscription.
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["DIST_TIMEOUT_SEC"] = "120"  # a dead rank fails the test instead of hanging it
    env.update({k: str(v) for k, v in (env_extra or {}).items()})
    return env


def run_script(script: str | os.PathLike, args: Sequence[str] = (), *, data_dir: Path,
               log_dir: Path, env_extra: Mapping[str, str] | None = None,
               cwd: str | os.PathLike = REPO, timeout: float = 300,
               nproc: int | None = None) -> TrainRun:
    """Run `script` (relative to cwd) with `sys.executable`, DATA_DIR and LOG_DIR set;
    with `nproc`, launch it via `python -m torch.distributed.run` on a free port."""
    env = child_env({"DATA_DIR": str(data_dir), "LOG_DIR": str(log_dir), **(env_extra or {})})
    if nproc is None:
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script)]
    cmd += [str(a) for a in args]
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s\n{out}\n{err}")
    # Every ending of every script run here leaves torch.distributed cleanly (distributed.comm).
    assert "outlived comm.shutdown()" not in proc.stdout + proc.stderr, proc.stdout[-3000:]
    return TrainRun(proc.returncode, proc.stdout, proc.stderr, Path(log_dir), Path(data_dir),
                    cmd)


# ----------------------------------------------------------------- N ranks in one test

def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = 60.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` real processes, gloo initialised in each (file-based
    rendezvous in a private temp dir: no ports to collide); return the results by rank.

    An exception on any rank fails the test with that rank's traceback; a rank that hangs
    (a mismatched collective) is killed after `timeout` s, so a broken test never hangs the
    suite. Ranks are forked where the platform allows it (Linux): they inherit the imported
    torch, and 8 ranks start in well under a second instead of many seconds."""
    require_marker(f"starts {world_size} ranks", "distributed")
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(r, world_size, store, timeout, fn, args, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()


def _rank_main(rank: int, world_size: int, store: str, timeout: float,
               fn: Callable[..., Any], args: tuple, results: Any) -> None:
    import torch.distributed as dist

    from distributed import comm

    torch.set_num_threads(1)  # ranks share a couple of cores; also keeps forked OpenMP idle
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        comm.reset()
        out = fn(*args)
        results.put((rank, None, out))
    except BaseException:  # noqa: BLE001 - everything goes back to pytest
        results.put((rank, traceback.format_exc(), None))
    finally:
        comm.shutdown()


def _collect(procs: list, results: Any, timeout: float) -> list[Any]:
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(len(procs))) - set(out))
            _kill(procs)
            raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s")
        try:
            rank, error, value = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in out and not p.is_alive() and p.exitcode not in (0, None)]
            if dead and results.empty():
                _kill(procs)
                code = procs[dead[0]].exitcode
                raise RuntimeError(f"rank {dead[0]} died (exit code {code})") from None
            continue
        if error is not None:
            _kill(procs)  # the other ranks may be blocked in a collective with the failed one
            raise AssertionError(f"rank {rank} failed:\n{error}")
        out[rank] = value
    return [out[r] for r in range(len(procs))]


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()


# ----------------------------------------------------------------- SLURM

# Variables of an outer launcher, a site or a profiler that must not reach a test's jobs.
SLURM_LEAKY_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DDP_MASTER_ADDR",
    "SITE", "SITE_LAUNCHER", "SITE_SRUN_ARGS", "SITE_MASTER_IFACE", "ENABLE_PROFILING",
    "PROFILE_OUTPUT", "TORCH_PROFILER_OUTPUT", "TRAIN_SCRIPT", "ENABLE_CUDA_GRAPHS",
    "DIST_CONNECT_TIMEOUT_SEC")


def generic_job_env(**extra: str) -> dict[str, str | None]:
    """What a user on a generic cluster exports before sbatch: the generic preset and a
    python, plus `extra` (DATA_DIR, LOG_DIR, ...); the leaky variables unset (None).
    Nothing about the rendezvous: export_DDP_vars.sh finds an address that resolves."""
    env: dict[str, str | None] = {k: None for k in SLURM_LEAKY_VARS}
    env.update(SITE="generic", PYTHON=sys.executable, **extra)
    return env


def start_slurm_cluster(nodes: int = 1):
    """A private SLURM cluster on this machine (tests/slurm_cluster.py), or a visible skip
    where it cannot run (not root, no packages): in the -ra summary, as a warning and on
    stderr. SLURM_TESTS_REQUIRED=1 turns the skip into a failure."""
    from slurm_cluster import ClusterUnavailable, SlurmCluster

    require_marker("starts a SLURM cluster", "slurm")
    try:
        return SlurmCluster(nodes=nodes).start()
    except ClusterUnavailable as e:
        skip_visibly("SLURM", f"no SLURM cluster on this machine: {e}", "SLURM_TESTS_REQUIRED")


def skip_visibly(what: str, reason: str, required_env: str) -> NoReturn:
    """Skip with the reason in the -ra summary, as a warning and on stderr; a failure
    instead when `required_env` is set (a machine where the tool must be there)."""
    if os.environ.get(required_env):
        pytest.fail(f"{reason} ({required_env} is set)")
    print(f"\nSKIPPED {what} tests: {reason}", file=sys.stderr)
    warnings.warn(reason, stacklevel=3)
    pytest.skip(reason)


def preempt_slurm_job(cluster, job: int, timeout: float) -> tuple[str, int]:
    """USR1 to a training job's tasks once its loop runs (what `sbatch --signal=USR1@T`
    sends before the time limit); then its output once it has COMPLETED with exit 0, and
    the iteration at which the signal stopped it."""
    try:
        cluster.wait_output(job, "Starting training loop", timeout=timeout)
    except TimeoutError as e:
        pytest.fail(str(e))
    cluster.signal(job, "USR1")
    out = slurm_job_output(cluster, job, timeout)
    stopped = re.search(r"Signal 10 received: stopped at iteration (\d+)", out)
    assert stopped, out[-4000:]
    return out, int(stopped.group(1))


def srun_on_two_nodes(srun: str, command: Sequence[str], launcher: str = "") -> list[str]:
    """`srun` of `command` as one task on each of two nodes of the job, `launcher` (the
    site's container launcher) in between. From inside a job step too, where the step's
    SLURM_NTASKS (1 for `srun -n 1 make test-gpu`) is inherited and would cap the tasks at
    one: hence `-n 2` next to `-N 2`. `--overlap`: the tasks share the CPUs of that step."""
    return [srun, "--overlap", "-N", "2", "-n", "2", "--ntasks-per-node=1",
            *shlex.split(launcher), *command]


def slurm_job_output(cluster, job: int, timeout: float) -> str:
    """The output of SLURM `job` once it has COMPLETED with exit 0; otherwise the test fails
    with the job's output and the SLURM daemons' logs."""
    try:
        state, code = cluster.wait(job, timeout=timeout)
    except TimeoutError as e:
        pytest.fail(f"{e}\n--- job output\n{cluster.output(job)[-4000:]}")
    out = cluster.output(job)
    assert (state, code) == ("COMPLETED", 0), \
        f"job {job}: {state} exit {code}\n--- job output\n{out[-4000:]}\n" \
        f"--- daemons\n{cluster.daemon_logs(10)}"
    return out


# ----------------------------------------------------------------- messages and tensors

def one_line(err: BaseException | pytest.ExceptionInfo) -> str:
    """The message of an error (or of `pytest.raises(...)`'s result): one non-empty line."""
    msg = str(err.value if isinstance(err, pytest.ExceptionInfo) else err)
    assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"
    return msg


def weighted_rmse_channels(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
                           tile: Any = None) -> torch.Tensor:
    """sqrt of `evaluation.scores.weighted_mse_channels`: the RMSE of each sample (a score
    averages MSEs over samples, not these: evaluation/scores.py), for tests of one sample."""
    from evaluation.scores import weighted_mse_channels

    return torch.sqrt(weighted_mse_channels(pred, target, weights, tile))


def kept_rows(modes: Any) -> list[int]:
    """Global row indices of the Fourier modes a `networks.spectral.Modes` keeps, in the
    order the spectrum stores them: frequencies 0 .. kh - 1, then the negative ones."""
    H = modes.grid[0]
    return list(range(modes.kh)) + list(range(H - modes.rows + modes.kh, H))


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, what: str,
                     rtol: float = 1e-5, atol: float = 0.0) -> None:
    """Same shape, and max |actual - expected| <= rtol * max |expected| + atol: a tolerance
    relative to the tensor's scale, so that near-zero entries (a sharded sum, a gradient)
    are judged by the rounding of the large ones they were computed with."""
    assert actual.shape == expected.shape, \
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:  # e.g. a rank that holds no Fourier mode
        return
    err = (actual - expected).abs().max().item()
    bound = rtol * expected.abs().max().item() + atol
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


# ----------------------------------------------------------- a parallel model vs the serial one

def assert_trains_like_serial(serial: torch.nn.Module, model: torch.nn.Module,
                              batches: Sequence[tuple], serial_loss: Callable,
                              parallel_loss: Callable, layout: str, lr: float, rtol: float,
                              atol_adam: float) -> None:
    """Adam steps side by side on the serial model and a model-parallel one (wrapped in DDP
    over dp when dp > 1): `serial_loss(model, x, y)` on the whole batch, `parallel_loss(model,
    x, y)` on this rank's part. After the first step the loss (averaged over dp) and every
    gathered gradient, after the last every gathered parameter, equal the serial ones; the
    replicated parameters stay bitwise identical on the ranks that share them. `model` may
    be sharded by FSDP over dp instead (its gradients and parameters are gathered too)."""
    import torch.distributed as dist
    from sharded import gather_full_grads, gather_full_state_dict

    from distributed import comm
    from distributed.helpers import sync_shared_gradients

    opt_serial = torch.optim.Adam(serial.parameters(), lr=lr)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for step, (x, y) in enumerate(batches):
        loss_serial = serial_loss(serial, x, y)
        loss_serial.backward()
        loss = parallel_loss(model, x, y)
        loss.backward()
        sync_shared_gradients(model)
        if step == 0:
            mean_loss = loss.detach().clone()
            if comm.get_size("dp") > 1:
                dist.all_reduce(mean_loss, group=comm.get_group("dp"))
            assert_close_rel(mean_loss / comm.get_size("dp"), loss_serial.detach(),
                             f"{layout} loss", rtol)
            grads = gather_full_grads(model)
            for name, p in serial.named_parameters():
                assert_close_rel(grads[name], p.grad, f"{layout} grad of {name}", rtol)
        opt_serial.step(), opt.step()
        opt_serial.zero_grad(), opt.zero_grad()
    full = gather_full_state_dict(model)
    for name, p in serial.named_parameters():
        assert_close_rel(full[name], p.detach(), f"{layout} {name} after {len(batches)} Adam "
                         "steps", rtol, atol_adam)
    for name, p in getattr(model, "module", model).named_parameters():
        mine = p.detach()
        mine = mine.to_local() if hasattr(mine, "to_local") else mine  # FSDP: this rank's slice
        for group_name in getattr(p, "is_shared_mp", ()):
            if comm.get_size(group_name) == 1:
                continue
            copies = [torch.empty_like(mine) for _ in range(comm.get_size(group_name))]
            dist.all_gather(copies, mine, group=comm.get_group(group_name))
            assert all(torch.equal(c, copies[0]) for c in copies), f"{name} over {group_name}"


def layout_of(cfg: Any) -> Any:
    """The Layout train_mp.py would decide for `cfg`, on the process groups `comm.init` made
    (inside `run_distributed`: no launcher environment, the CPU)."""
    from distributed.layout import Layout

    return Layout.of_groups(cfg, None, torch.device("cpu"))


# ----------------------------------------------------------------- what a run logged and saved

def assert_completed(run: TrainRun, iters: int | None = None, epochs: int | None = None
                     ) -> None:
    """Exit 0, no traceback, "Finished <iters> iterations"; with `epochs`, each of the
    end-of-epoch lines logged that many times."""
    assert run.returncode == 0, f"exit {run.returncode}\n{run.output[-4000:]}"
    assert "Traceback" not in run.output, run.output[-4000:]
    finished = "Finished" if iters is None else f"Finished {iters} iterations"
    assert finished in run.stdout, run.stdout[-3000:]
    for line in EPOCH_LINES if epochs is not None else ():
        assert run.stdout.count(line) == epochs, (line, run.stdout[-3000:])


def assert_one_error_line(run: TrainRun, words: Sequence[str]) -> str:
    """Exit 2, no traceback, exactly one `error:` line on stderr, naming every word."""
    assert run.returncode == 2, f"exit {run.returncode}\n{run.output[-3000:]}"
    assert "Traceback" not in run.output, run.output[-3000:]
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, run.stderr
    for word in words:
        assert word in errors[0], (word, errors[0])
    return errors[0]


def losses(run: TrainRun) -> dict[str, list[float]]:
    """The losses a train script logs: the untrained model's validation loss, then one
    train and one validation loss per epoch (nan / inf read as such)."""
    def values(label: str) -> list[float]:
        return [float(v) for v in re.findall(rf"{label}=([-+0-9.eEnaif]+)", run.stdout)]

    return {"initial": values("Initial val loss"), "train": values("Avg train loss"),
            "val": values("Avg val loss")}


def epoch_losses(output: str) -> list[tuple[str, str, str]]:
    """(epoch, train loss, val loss) as logged, in order, as text: for exact comparisons."""
    epochs = re.findall(r"Time taken for epoch (\d+) ", output)
    train = re.findall(r"Avg train loss=(\S+)", output)
    val = re.findall(r"Avg val loss=(\S+)", output)
    assert len(epochs) == len(train) == len(val), output[-3000:]
    return list(zip(epochs, train, val, strict=True))


def final_checkpoint(exp_dir: Path, iters: int | None = None) -> dict:
    """The newest checkpoint of a run directory (which must be ckpt_<iters>.pt if given),
    loaded as a resume loads it (weights_only)."""
    from training.checkpoint import latest_checkpoint

    path = latest_checkpoint(str(exp_dir))
    assert path, f"no checkpoint in {exp_dir}"
    if iters is not None:
        assert Path(path).name == f"ckpt_{iters:08d}.pt", f"newest checkpoint is {path}"
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_state(resumed: dict, reference: dict) -> None:
    """Bitwise: every parameter and optimizer tensor, the schedule, the loop position."""
    for key in ("iters", "epoch", "epoch_step", "scheduler", "scaler"):
        assert resumed[key] == reference[key], key
    assert resumed["model"].keys() == reference["model"].keys()
    for name, tensor in reference["model"].items():
        assert torch.equal(resumed["model"][name], tensor), f"parameter {name} differs"
    for name, state in reference["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(resumed["optimizer"]["state"][name][key], value), (name, key)


def max_param_difference(a: dict, b: dict) -> float:
    """Largest |difference| between the parameters of two checkpoints."""
    assert a["model"].keys() == b["model"].keys()
    return max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])


@dataclass(frozen=True)
class Tolerances:
    """How far two runs of the same training may drift apart by rounding alone."""
    loss_rtol: float    # the printed losses
    param_atol: float   # the final parameters
    moment_rtol: float  # Adam's moments, relative to each tensor's largest entry


# fp32 on CPU, 16 Adam steps at lr 1e-3 (tests/test_ddp.py says why): the printed losses have
# 6 decimals; parameters measured <= 3e-7 apart (1e-5 is 1 % of one Adam step); moments ~1e-6.
# Adam's update is scale invariant, its moments are not: they catch a gradient summed instead
# of averaged, or reduced over the wrong group.
CPU_FP32 = Tolerances(loss_rtol=1e-5, param_atol=1e-5, moment_rtol=1e-4)


def assert_same_training(run: TrainRun, ref: TrainRun, world_size: int,
                         ref_world_size: int = 1, tol: Tolerances = CPU_FP32, *,
                         config: str = "tiny", iters: int = TINY_ITERS, kind: str = "CPU"
                         ) -> None:
    """Same logged losses, final parameters and Adam moments as `ref`, within `tol`."""
    got, want = losses(run), losses(ref)
    assert want["train"] and len(got["train"]) == len(want["train"]) == len(want["val"]), \
        (got, want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=tol.loss_rtol), (key, got, want)
    a = final_checkpoint(run.exp_dir(config, world_size, kind=kind), iters)
    b = final_checkpoint(ref.exp_dir(config, ref_world_size, kind=kind), iters)
    diff = max_param_difference(a, b)
    assert diff <= tol.param_atol, f"parameters differ by up to {diff:.3g}"
    for name, state in b["optimizer"]["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            want_m, got_m = state[moment].float(), a["optimizer"]["state"][name][moment].float()
            scale = want_m.abs().max().item()
            err = (got_m - want_m).abs().max().item()
            assert err <= tol.moment_rtol * scale, (name, moment, err, scale)


# ----------------------------------------------------------------- forecast scores by hand

def lat_weights(latitudes: Sequence[float]) -> list[float]:
    """WeatherBench-2's weights of rows at `latitudes` (degrees, any order), written out: a
    row's cell reaches halfway to its neighbours (to the pole for the first and last row),
    its weight is the cell's area, sin(upper) - sin(lower), over the mean of all rows'."""
    order = sorted(range(len(latitudes)), key=lambda i: latitudes[i])
    lat = [math.radians(latitudes[i]) for i in order]
    bounds = ([-math.pi / 2] + [(lat[k] + lat[k + 1]) / 2 for k in range(len(lat) - 1)]
              + [math.pi / 2])
    areas = [0.0] * len(lat)
    for k, i in enumerate(order):
        areas[i] = math.sin(bounds[k + 1]) - math.sin(bounds[k])
    mean = sum(areas) / len(areas)
    return [a / mean for a in areas]


def reference_scores(pred: np.ndarray, truth: np.ndarray, clim: np.ndarray,
                     latitudes: Sequence[float] | None = None,
                     weights: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """RMSE (sqrt of the mean over ICs of the weighted MSE) and mean ACC, (L+1, C), by loops.
    pred, truth: (B, L+1, C, H, W) physical; clim: (C, H, W) or (B, L+1, C, H, W) physical;
    the rows' `latitudes` (WeatherBench-2's weights of that grid), or their `weights`."""
    clim = np.broadcast_to(clim, truth.shape)
    n, leads, channels, h, w = truth.shape
    wts = list(weights) if weights is not None else lat_weights(latitudes)
    rmse, acc = np.zeros((leads, channels)), np.zeros((leads, channels))
    for k in range(leads):
        for c in range(channels):
            mse_sum = acc_sum = 0.0
            for b in range(n):
                se = num = pp = tt = 0.0
                for i in range(h):
                    for j in range(w):
                        p, t, m = (float(pred[b, k, c, i, j]), float(truth[b, k, c, i, j]),
                                   float(clim[b, k, c, i, j]))
                        se += wts[i] * (p - t) ** 2
                        num += wts[i] * (p - m) * (t - m)
                        pp += wts[i] * (p - m) ** 2
                        tt += wts[i] * (t - m) ** 2
                mse_sum += se / (sum(wts) * w)
                acc_sum += num / math.sqrt(pp * tt) if pp > 0 else 0.0
            rmse[k, c] = math.sqrt(mse_sum / n)
            acc[k, c] = acc_sum / n
    return rmse, acc
