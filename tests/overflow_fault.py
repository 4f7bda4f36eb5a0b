"""A train script run as a user runs it, with one gradient element forced to inf: the fp16
overflow tests (tests/test_fp16_overflow_scripts.py, tests/gpu/test_gpu_parallel.py).

    [torchrun ...] python tests/overflow_fault.py RECORD_DIR PARAM STEP MP_RANK SCRIPT [ARGS]

runs SCRIPT (train.py, train_mp.py, train_mp_graphs.py) with ARGS. At training step STEP
(0-based), on the rank whose model-parallel rank is MP_RANK (and data-parallel rank 0), the
first element of parameter PARAM's gradient becomes inf just before the optimizer step,
i.e. after backward and the model-parallel gradient sums, where an fp16 overflow in that
rank's own shard would show. Every rank appends one JSON line per optimizer step to
RECORD_DIR/rank<world rank>.jsonl: the step, the loss scale after it, and how many updates
Adam has applied (a skipped step applies none). The CUDA-graph step runs the optimizer step
eagerly after the replay, so the fault reaches it the same way; its warm-up steps (before
the loop, step 0) are recorded too and are overwritten by the loop's.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    record_dir, param, at, mp_rank, script = sys.argv[1:6]
    sys.argv = [script, *sys.argv[6:]]
    sys.path.insert(0, str(REPO))
    import torch

    from distributed import comm
    from training import step as step_module

    inner = step_module.optimizer_step

    def optimizer_step(run, zero_grad: bool = True) -> None:  # noqa: ANN001
        iters = run.progress.iters
        faulty = comm.get_rank("mp") == int(mp_rank) and comm.get_rank("dp") == 0
        if iters == int(at) and faulty:
            model = getattr(run.model, "_orig_mod", run.model)  # torch.compile
            model = getattr(model, "module", model)  # DDP
            with torch.no_grad():
                dict(model.named_parameters())[param].grad.view(-1)[0] = float("inf")
        inner(run, zero_grad)
        updates = [float(s["step"]) for s in run.optimizer.state.values() if "step" in s]
        record = {"step": iters, "scale": run.scaler.get_scale(),
                  "adam_updates": max(updates, default=0.0)}
        path = Path(record_dir) / f"rank{comm.get_world_rank()}.jsonl"
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    step_module.optimizer_step = optimizer_step  # before the script imports it by name
    runpy.run_path(script, run_name="__main__")


def read_records(record_dir: Path) -> dict[int, dict[int, dict]]:
    """{world rank: {step: its last record}}."""
    out: dict[int, dict[int, dict]] = {}
    for path in sorted(Path(record_dir).glob("rank*.jsonl")):
        rank = int(path.stem[4:])
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out.setdefault(rank, {})[record["step"]] = record
    return out


if __name__ == "__main__":
    main()
