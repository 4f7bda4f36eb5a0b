"""The ladder on the device: the `short` config's samples/s for each tutorial optimisation in
turn, with MFU from the model's counted FLOPs (`networks.training_flops`), beside the
numbers the tutorial published for an A100-40GB.

Each row adds one change to the row above (LADDER); every row but the last is built, warmed
up and stepped by bench/step_runner.py exactly as train.py builds and steps it (the real
loader over a synthetic full-size data set on local disk, so the loader rows are what a
node's page cache gives, not a parallel file system); the CUDA-graph row runs
train_mp_graphs.py itself and reads the samples/s of its last epoch. A row is measured as
the median of `iters` full steps after its warm-up (compile included there); rows whose
set-up would not fit the time left are skipped, and said. Each row runs through the checks'
guard (`report.run_line`): one that raises (out of memory, a compile error, a timeout) is
its own line, and the rows after it still run. MFU: model FLOP/s over the
GPU's dense peak for the row's precision (PEAK_TFLOPS, by name; TF32 for fp32 rows,
which run TF32 matmuls as training sets them), and over a measured large matmul's rate.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tools.gpu_check import checks
from tools.gpu_check.report import Line, Skip, run_line

# label, the change from the row above, the tutorial's A100-40GB samples/s for that step,
# the row's estimated seconds on one H100/H200 (set-up, warm-up, steps; not yet measured)
LADDER: list[tuple[str, dict[str, Any], float | None, float]] = [
    ("fp32, no loader workers",
     {"amp_mode": "none", "enable_fused": False, "enable_jit": False, "num_data_workers": 0,
      "data_loader_config": "pytorch", "prefetch_thread": False}, 9.3, 25),
    ("+ 4 loader workers", {"num_data_workers": 4}, 12.4, 15),
    ("+ DALI", {"data_loader_config": "dali"}, 13.3, 15),
    ("+ bf16", {"amp_mode": "bf16"}, 42.6, 15),
    ("+ fused Adam", {"enable_fused": True}, 42.7, 15),
    ("+ torch.compile", {"enable_jit": True}, 42.8, 55),
]
GRAPHS = ("+ CUDA graphs", 50)  # its compile finds the row above's kernels in the cache
DATA_ESTIMATE_S = 0  # the data set is generated while the checks run (__main__.start_data)
# Dense peaks (TFLOP/s) by GPU name: bf16/fp16, TF32, fp32 (the vendors' data sheets; SXM
# unless the name says PCIe). Unknown GPUs get MFU against the measured matmul only.
PEAK_TFLOPS = {"A100": (312, 156, 19.5), "H100 PCIe": (756, 378, 51),
               "H100": (989, 494, 67), "H200": (989, 494, 67), "GH200": (989, 494, 67)}
SAMPLES_PER_YEAR = 33  # 32 training pairs: 2 steps of 16 per epoch, ~0.7 GB per split


def peak_tflops(name: str, dtype: torch.dtype) -> float | None:
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100"
        if key in name:
            bf16, tf32, fp32 = PEAK_TFLOPS[key]
            if dtype in (torch.bfloat16, torch.float16):
                return bf16
            return tf32 if torch.backends.cuda.matmul.allow_tf32 else fp32
    return None


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """Best of 3 n^3 matmuls (smaller on a CPU)."""
    from bench.ceilings import sync

    n = n if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(3):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def data_set(work: Path, img_size: tuple[int, int]) -> Path:
    """A small synthetic data set of the config's grid (made once per work folder)."""
    from data.synthetic import generate

    out = work / f"data_{img_size[0]}x{img_size[1]}"
    if not (out / "stats" / "time_means.npy").exists():
        generate(out, img_size=img_size, samples_per_year=SAMPLES_PER_YEAR, seed=0,
                 train_years=1, valid_years=1, test_years=1)
    return out


def paths(data: Path) -> dict[str, str]:
    return {"train_data_path": str(data / "train"), "valid_data_path": str(data / "valid"),
            "inf_data_path": str(data / "test"),
            "time_means_path": str(data / "stats" / "time_means.npy"),
            "global_means_path": str(data / "stats" / "global_means.npy"),
            "global_stds_path": str(data / "stats" / "global_stds.npy")}


def row_line(label: str, cfg: Any, sps: float, device: torch.device, published: float | None,
             ceilings: dict[torch.dtype, float], extra: dict[str, Any]) -> Line:
    from bench.ceilings import precision_label
    from networks import training_flops
    from utils.precision import autocast_dtype

    dtype = autocast_dtype(cfg.amp_mode) or torch.float32
    tflops = training_flops(cfg) * sps / 1e12
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = peak_tflops(name, dtype) if device.type == "cuda" else None
    if dtype not in ceilings:
        ceilings[dtype] = matmul_tflops(device, dtype)
    mfu = f"MFU {tflops / peak:.1%} of {peak:g}" if peak else "MFU: peak unknown"
    number = (f"{sps:.1f} samples/s, {precision_label(dtype, device)}; {tflops:.3g} model "
              f"TFLOP/s, {mfu}, {tflops / ceilings[dtype]:.0%} of a measured matmul")
    note = f"A100-40GB (tutorial): {published}" if published else ""
    return Line("ladder", label, "info", number, note,
                data={"samples_per_s": sps, "model_tflops": tflops, "peak_tflops": peak,
                      "mfu": tflops / peak if peak else None,
                      "matmul_tflops": ceilings[dtype], "published_a100": published, **extra})


def run_ladder(device: torch.device, work: Path, budget_s: float, config: str = "short",
               iters: int = 4, rows: int = len(LADDER), log: Path | None = None
               ) -> Iterator[Line]:
    """The first `rows` rows of LADDER, then the CUDA-graph row, within `budget_s` seconds
    (module docstring), each a report line as soon as it is measured. Every row runs
    through the checks' guard (`run_line`): one that raises (out of memory, a compile
    error, a timeout) is its line, and the rows after it still run."""
    start = time.perf_counter()
    made: dict[str, Any] = {}
    setup = run_line("ladder", "data set", lambda: set_up(device, work, config, made),
                     DATA_ESTIMATE_S, log)
    yield setup
    if setup.status != "info":
        for label, *_ in LADDER[:rows]:
            yield Line("ladder", label, "skip", detail="not run: no data set (the line "
                       "'data set')")
        return
    cfg, layout, ceilings, slowest = made["cfg"], made["layout"], {}, 0.0
    for label, change, published, estimate in LADDER[:rows]:
        why = cannot_run(change, device)
        if why:
            yield Line("ladder", label, "skip", detail=why, estimate_s=estimate)
            continue
        cfg = cfg.replace(**change)
        left = budget_s - (time.perf_counter() - start)
        if left < 2 * slowest + 20:
            yield Line("ladder", label, "skip", detail=f"the time budget is spent "
                       f"({left:.0f} s left)", estimate_s=estimate)
            continue
        line = run_line("ladder", label, lambda cfg=cfg, label=label, published=published:
                        measure_row(label, cfg, layout, device, iters, published, ceilings),
                        estimate, log)
        slowest = max(slowest, line.seconds)
        yield line
    left = budget_s - (time.perf_counter() - start)
    yield run_line("ladder", GRAPHS[0], lambda: graphs_row(cfg, device, work, left, ceilings),
                   GRAPHS[1], log)


def set_up(device: torch.device, work: Path, config: str, made: dict[str, Any]) -> Line:
    """The ladder's config on its data set (made once per work folder), into `made`."""
    from tools.gpu_check import harness
    from utils.config import read_config

    base = read_config(str(harness.CONFIG_FILE), config, environ={})
    data = data_set(work, tuple(base.img_size))
    made["cfg"] = base.replace(**paths(data), expdir=str(work / "ladder_logs"))
    made["layout"] = harness.layout_of(made["cfg"], device)
    return Line("ladder", "data set", "info", f"config {config}, {base.img_size[0]} x "
                f"{base.img_size[1]}", str(data))


def measure_row(label: str, cfg: Any, layout: Any, device: torch.device, iters: int,
                published: float | None, ceilings: dict[torch.dtype, float]) -> Line:
    """One row: built, warmed up and stepped by bench/step_runner.py as train.py would."""
    from bench.step_runner import StepRunner
    from training.setup import batch_sizes

    runner = StepRunner(label, cfg, layout)
    try:
        runner.warm_up(2)
        times = runner.full(iters, untimed=runner.prefetched)
    finally:
        runner.close()
    batch, _ = batch_sizes(cfg, 1)
    return row_line(label, cfg, batch / statistics.median(times), device, published,
                    ceilings, {"first_step_s": runner.first_step_s})


def cannot_run(change: dict[str, Any], device: torch.device) -> str | None:
    """Why a row cannot run here (the rows after it run without its change), or None."""
    if change.get("data_loader_config") == "dali":
        try:
            import nvidia.dali  # noqa: F401
        except ImportError:
            return "DALI is not installed (pip install nvidia-dali-cuda120, or your CUDA's)"
    if change.get("amp_mode") == "bf16":
        from tools.gpu_check.environment import supports

        if not supports(device)["bf16"]:
            return f"no native bf16 on {device}"
    return None


EPOCH = re.compile(r"avg ([\d.]+) samples/sec")


def graphs_row(cfg: Any, device: torch.device, work: Path, left: float,
               ceilings: dict[torch.dtype, float]) -> Line:
    """The last row: train_mp_graphs.py with the row above's settings (a process of its
    own), the samples/s of its last epoch."""
    checks.needs_cuda(device, "CUDA-graph capture")
    if left < 90:
        raise Skip(f"the time budget is spent ({left:.0f} s left)")
    flags = [f"--config={cfg.config}", "--num_iters=8", "--graph_warmup=3",
             f"--amp_mode={cfg.amp_mode}", f"--num_data_workers={cfg.num_data_workers}",
             f"--data_loader_config={cfg.data_loader_config}", "--skip_initial_validation"]
    flags += ["--enable_fused"] if cfg.enable_fused else []
    flags += ["--enable_jit"] if cfg.enable_jit else []
    data = Path(cfg.train_data_path).parent
    _, out = checks.script_losses("train_mp_graphs.py", flags, data, work / "graphs_logs",
                                  timeout=max(left - 10, 60), fp32=False)
    rates = [float(v) for v in EPOCH.findall(out)]
    if not rates:
        raise RuntimeError("train_mp_graphs.py logged no samples/s")
    line = row_line(GRAPHS[0], cfg, rates[-1], device, None, ceilings,
                    {"epochs": rates, "separate_process": True})
    line.detail = "its own process: the last of 4 epochs of 2 steps"
    return line
