"""The gpu-check's correctness checks. Each is a function of the device (and a work folder)
returning an `Outcome`, or raising `Skip` where it cannot run; the checks that mean something
on a CPU run there in the tests (tests/test_gpu_check.py), the others say they need CUDA.

    name            proves                                                  runs on
    graph replay    train_mp_graphs.py's replayed step trains as train_mp.py CUDA
    compile         the compiled model trains as the eager one              any
    fp16 overflow   an inf gradient skips the step and halves the scale     any
    bf16 + fused    bf16 autocast with fused Adam trains as fp32 does       bf16 devices
    recompute       activation checkpointing trains as the plain model, at  any
                    a lower peak of the tensors alive
    FSDP one rank   FSDP2 on a one-rank group trains as the plain model     any
    FSDP + compile  --fsdp --enable_jit (block by block) trains as eager    any
    TF32            TF32 is on (as training sets it) and what it changes    CUDA

Tolerances: fp32 runs compared with each other: losses within FP32_RTOL (a GPU does not add
in a fixed order), parameters after the steps within PARAM_ATOL (10 % of one Adam step at
the checks' lr 1e-3: Adam turns a tiny difference of a near-zero gradient into a step's
difference), the bounds of the GPU self-test's `GPU_FP32`; bf16 against fp32 within
BF16_RTOL of the loss.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn as nn

from tools.gpu_check import harness
from tools.gpu_check.report import Outcome, Skip
from utils.config_schema import Config

FP32_RTOL = {"cpu": 1e-5, "cuda": 1e-4}
PARAM_ATOL = 1e-4
BF16_RTOL = 3e-2  # 8 mantissa bits: a few steps of a tiny model stay within 3 % of fp32
STEPS = 4


def needs_cuda(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        raise Skip(f"{what} needs a GPU")


def _compare(name: str, device: torch.device, a: tuple[list[float], dict],
             b: tuple[list[float], dict], data: dict | None = None) -> Outcome:
    """Losses (FP32_RTOL) and final parameters (PARAM_ATOL) of two fp32 runs."""
    rtol = FP32_RTOL[device.type]
    loss_err = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a[0], b[0], strict=True))
    param_err = harness.largest_difference(a[1], b[1])
    ok = loss_err <= rtol and param_err <= PARAM_ATOL
    return Outcome(ok, f"losses {loss_err:.1e} (relative), parameters {param_err:.1e} apart",
                   "" if ok else f"{name}: losses more than {rtol:g} or parameters more "
                   f"than {PARAM_ATOL:g} apart",
                   {"loss_rel_err": loss_err, "param_abs_err": param_err, "rtol": rtol,
                    "param_atol": PARAM_ATOL, "losses": b[0], **(data or {})})


def _run(cfg: Config, device: torch.device, model: nn.Module | None = None,
         amp_mode: str | None = None, seed: int = 1) -> tuple[list[float], dict]:
    """The losses of STEPS steps of the config's run, and its parameters after them."""
    run = harness.build(cfg, device, model, amp_mode)
    losses = harness.train(run, harness.batches(cfg, device, STEPS, seed))
    return losses, harness.parameters(run.model)


def compile_equals_eager(device: torch.device, work: Path) -> Outcome:
    """torch.compile (the whole model and the loss, as train.py compiles them) trains as
    the eager model, fp32."""
    with harness.fp32_matmuls(device):
        eager = _run(harness.small_config(str(work)), device)
        start = time.perf_counter()
        compiled = _run(harness.small_config(str(work), enable_jit=True), device)
    out = _compare("compiled and eager", device, compiled, eager,
                   {"compile_and_steps_s": time.perf_counter() - start,
                    **harness.compile_counts()})
    out.number += f"; {out.data['compile_and_steps_s']:.0f} s with the compile"
    return out


def fp16_overflow(device: torch.device, work: Path) -> Outcome:
    """fp16 with loss scaling: an inf put into one gradient makes the scaler skip that
    step (the parameters stay as they were) and halve the scale; the next step trains."""
    from training.step import forward_backward, optimizer_step

    cfg = harness.small_config(str(work), amp_mode="fp16")
    run = harness.build(cfg, device)
    (x, y), = harness.batches(cfg, device, 1)
    forward_backward(run, x, y)
    optimizer_step(run)  # a normal step first: Adam's state exists
    before = {k: v.clone() for k, v in harness.parameters(run.model).items()}
    scale = run.scaler.get_scale()
    forward_backward(run, x, y)
    next(p for p in run.model.parameters() if p.grad is not None).grad.view(-1)[0] = \
        float("inf")
    optimizer_step(run)
    kept = all(torch.equal(before[k], v) for k, v in harness.parameters(run.model).items())
    halved = run.scaler.get_scale() == scale / 2
    forward_backward(run, x, y)
    optimizer_step(run)
    moved = harness.largest_difference(harness.parameters(run.model), before) > 0
    ok = kept and halved and moved
    why = [w for w, bad in (("the step was not skipped", not kept),
                            (f"the scale went {scale:g} -> {run.scaler.get_scale():g}",
                             not halved), ("the next step did not train", not moved)) if bad]
    return Outcome(ok, f"step skipped: {kept}, scale {scale:g} -> {scale / 2:g}: {halved}",
                   "; ".join(why), {"skipped": kept, "halved": halved, "scale": scale})


def bf16_fused_adam(device: torch.device, work: Path) -> Outcome:
    """bf16 autocast with fused Adam trains as fp32 with plain Adam does, within BF16_RTOL
    of the loss at every step."""
    from tools.gpu_check.environment import supports

    if not supports(device)["bf16"]:
        raise Skip(f"no native bf16 on {device}")
    with harness.fp32_matmuls(device):
        fp32 = _run(harness.small_config(str(work)), device)
        bf16 = _run(harness.small_config(str(work), amp_mode="bf16", enable_fused=True),
                    device)
    err = max(abs(a - b) / abs(b) for a, b in zip(bf16[0], fp32[0], strict=True))
    finite = all(map(lambda v: v == v and abs(v) < float("inf"), bf16[0]))
    ok = finite and err <= BF16_RTOL
    return Outcome(ok, f"losses within {err:.1e} of fp32's (relative)", "" if ok else
                   f"bf16 losses {bf16[0]} against fp32 {fp32[0]}",
                   {"loss_rel_err": err, "bf16": bf16[0], "fp32": fp32[0]})


def recompute_equals_plain(device: torch.device, work: Path) -> Outcome:
    """Activation checkpointing (blocks) trains as the plain model, with a lower peak of
    the tensors alive (`tensor_peak_mib`)."""
    peaks, runs = {}, {}
    with harness.fp32_matmuls(device):
        for mode in ("none", "blocks"):
            cfg = harness.small_config(str(work), activation_checkpointing=mode)
            with tensor_peak_mib(device) as peaks[mode]:
                runs[mode] = _run(cfg, device)
    out = _compare("recompute and plain", device, runs["blocks"], runs["none"],
                   {"peak_mib": {mode: peak[0] for mode, peak in peaks.items()}})
    blocks, plain = peaks["blocks"][0], peaks["none"][0]
    out.number += f"; peak {blocks:.3f} vs {plain:.3f} MiB ({blocks / plain - 1:+.0%})"
    if blocks >= plain:
        out.ok = False
        out.detail = "; ".join(filter(None, [out.detail, "recompute did not lower the peak"]))
    return out


@contextlib.contextmanager
def tensor_peak_mib(device: torch.device) -> Iterator[list[float]]:
    """The peak of the tensors alive while the block runs, MiB, in the list it yields
    (filled at its end): on a GPU the caching allocator's `max_memory_allocated`; on a
    CPU the profiler's allocation events (bench/bench_memory.py's `allocation_peaks`,
    as the memory planner's CPU tests measure), which no allocator's caching blurs."""
    found: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield found
        torch.cuda.synchronize(device)
        found.append(torch.cuda.max_memory_allocated(device) / 2**20)
        return
    from torch.profiler import ProfilerActivity, profile

    from bench.bench_memory import allocation_peaks

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield found
    found.append(allocation_peaks(prof)[0] / 2**20)


def fsdp_one_rank(device: torch.device, work: Path) -> Outcome:
    """FSDP2 over a one-rank group trains as the plain model (its hooks, gathers and
    reduce-scatters on this device's backend)."""
    cfg = harness.small_config(str(work))
    with harness.fp32_matmuls(device):
        plain = _run(cfg, device)
        sharded = _run(cfg, device, model=harness.fsdp_one_rank(cfg, device))
    return _compare("FSDP and plain", device, sharded, plain)


def fsdp_compile(device: torch.device, work: Path) -> Outcome:
    """`--fsdp --enable_jit`: each block compiled before fully_shard, one graph without a
    break, and it trains as eager FSDP."""
    cfg = harness.small_config(str(work), fsdp=True)
    with harness.fp32_matmuls(device):
        eager = _run(cfg, device, model=harness.fsdp_one_rank(cfg, device))
        harness.reset_compile_counts()
        jit = cfg.replace(enable_jit=True)
        compiled = _run(jit, device, model=harness.fsdp_one_rank(jit, device))
    graphs = harness.compile_counts()
    out = _compare("FSDP compiled and eager", device, compiled, eager, graphs)
    whole = graphs["graphs"] >= 1 and graphs["graph_breaks"] == 0
    out.number += f"; {graphs['graphs']} graph(s), {graphs['graph_breaks']} break(s)"
    if not whole:
        out.ok, out.detail = False, "the blocks did not compile into whole graphs"
    return out


def tf32(device: torch.device, work: Path) -> Outcome:
    """TF32 matmuls are on as training sets them (unless NVIDIA_TF32_OVERRIDE=0), faster
    than fp32, and round to TF32 (about 1e-3 relative)."""
    from distributed.comm import set_cuda_defaults

    needs_cuda(device, "TF32")
    set_cuda_defaults()
    on = torch.backends.cuda.matmul.allow_tf32
    n = 4096
    a, b = (torch.randn(n, n, device=device) for _ in range(2))
    rates, results = {}, {}
    for mode in (True, False):
        torch.backends.cuda.matmul.allow_tf32 = mode
        results[mode] = a @ b
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize(device)
        rates[mode] = 10 * 2 * n**3 / (time.perf_counter() - start) / 1e12
    torch.backends.cuda.matmul.allow_tf32 = on
    diff = float((results[True] - results[False]).abs().max() / results[False].abs().max())
    override = os.environ.get("NVIDIA_TF32_OVERRIDE")
    ok = on == (override != "0") and (diff > 0 or override == "0")
    return Outcome(ok, f"on: {on}; {n}^3 matmul {rates[True]:.0f} TFLOP/s TF32 vs "
                   f"{rates[False]:.0f} fp32, {diff:.1e} apart",
                   "" if ok else "TF32 is not switched as step 5 of the README says",
                   {"on": on, "tf32_tflops": rates[True], "fp32_tflops": rates[False],
                    "rel_diff": diff})


def graph_replay(device: torch.device, work: Path, timeout: float = 300) -> Outcome:
    """train_mp_graphs.py (the step captured after 3 warm-up steps, then replayed) logs the
    losses of train_mp.py's eager step, fp32, on the tiny config: two runs of the scripts
    as a user runs them."""
    needs_cuda(device, "CUDA-graph capture")
    return compare_scripts(work, timeout)


LOSS = re.compile(r"(Initial val loss|Avg train loss|Avg val loss)=([-+0-9.eEnaif]+)")


def script_losses(script: str, args: list[str], data: Path, logs: Path, timeout: float,
                  fp32: bool = True) -> tuple[list[float], str]:
    """The losses a train script logs (the untrained validation, then each epoch's train and
    validation loss), and its output. `fp32`: without TF32 (equality checks); else as
    training runs by default."""
    env = {**os.environ, "DATA_DIR": str(data), "LOG_DIR": str(logs)}
    if fp32:
        env.update(NVIDIA_TF32_OVERRIDE="0", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    else:
        env.pop("NVIDIA_TF32_OVERRIDE", None)
    proc = subprocess.run([sys.executable, script, *args], cwd=harness.REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode:
        tail = [line for line in out.splitlines() if line.strip()][-1:]
        raise RuntimeError(f"{script} exit {proc.returncode}: {tail[0] if tail else ''}")
    return [float(v) for _, v in LOSS.findall(out)], out


def compare_scripts(work: Path, timeout: float) -> Outcome:
    from data.synthetic import generate

    data = work / "tiny_data"
    if not (data / "stats" / "time_means.npy").exists():
        generate(data, img_size=(16, 32), samples_per_year=24, train_years=2,
                 valid_years=1, test_years=1, seed=0)
    args = ["--config=tiny", "--num_iters=16"]
    eager, _ = script_losses("train_mp.py", args, data, work / "eager", timeout)
    graphs, out = script_losses("train_mp_graphs.py", [*args, "--graph_warmup=3"], data,
                                work / "graphs", timeout)
    captured = "Capturing the training step in a CUDA graph" in out
    err = max((abs(a - b) / abs(b) for a, b in zip(graphs, eager, strict=True)), default=1.0)
    rtol = FP32_RTOL["cuda"]
    ok = captured and len(graphs) == len(eager) > 2 and err <= rtol
    why = "" if ok else ("no capture: " if not captured else "") + \
        f"losses {graphs} against eager {eager}"
    return Outcome(ok, f"{len(graphs)} logged losses within {err:.1e} of eager's", why,
                   {"graphs": graphs, "eager": eager, "captured": captured})


# name, function, the estimate on one H100/H200 (seconds: docs/gpu_first_run.md)
CHECKS: list[tuple[str, Callable[[torch.device, Path], Outcome], float]] = [
    ("eager step = CUDA-graph replay", graph_replay, 35),
    ("compile = eager", compile_equals_eager, 40),
    ("fp16 with a forced overflow", fp16_overflow, 5),
    ("bf16 + fused Adam", bf16_fused_adam, 5),
    ("activation recomputation = plain", recompute_equals_plain, 5),
    ("FSDP on a one-rank group", fsdp_one_rank, 5),
    ("--fsdp --enable_jit = eager FSDP", fsdp_compile, 25),
    ("TF32", tf32, 5),
]
