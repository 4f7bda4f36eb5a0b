"""A train script run as a user runs it, with one gradient element forced to inf: the fp16
overflow tests (tests/test_fp16_overflow_scripts.py, tests/gpu/test_gpu_parallel.py).

    [torchrun ...] python tests/overflow_fault.py [--in_backward] RECORD_DIR PARAM STEP MP_RANK
                                                  SCRIPT [ARGS]

runs SCRIPT (train.py, train_mp.py, train_mp_graphs.py) with ARGS. At training step STEP
(0-based), on the rank whose model-parallel rank is MP_RANK (and data-parallel rank 0), the
first element of parameter PARAM's gradient becomes inf just before the optimizer step,
i.e. after backward and the model-parallel gradient sums, where an fp16 overflow in that
rank's own shard would show. With --in_backward it becomes inf in backward instead, as the
gradient of PARAM is computed (a tensor hook): before DDP's reduction over the data-parallel
ranks, where an overflow really happens (an eager step only: a replayed CUDA graph runs no
hook). Every rank appends one JSON line per optimizer step to
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
    in_backward = sys.argv[1] == "--in_backward"
    if in_backward:
        del sys.argv[1]
    record_dir, param, at, mp_rank, script = sys.argv[1:6]
    sys.argv = [script, *sys.argv[6:]]
    sys.path.insert(0, str(REPO))
    import torch

    from distributed import comm
    from training import step as step_module
    from training.run import Training

    inner, inner_backward = step_module.optimizer_step, step_module.forward_backward

    def faulty_param(run) -> torch.nn.Parameter | None:  # noqa: ANN001
        """PARAM on the faulty rank at step STEP, else None."""
        faulty = comm.get_rank("mp") == int(mp_rank) and comm.get_rank("dp") == 0
        if run.progress.iters != int(at) or not faulty:
            return None
        model = getattr(run.model, "_orig_mod", run.model)  # torch.compile
        model = getattr(model, "module", model)  # DDP
        return dict(model.named_parameters())[param]

    def inf_first(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    def forward_backward(run, inp, tar, noise=None):  # noqa: ANN001, ANN202
        p = faulty_param(run) if in_backward and isinstance(run, Training) else None
        hook = p.register_hook(inf_first) if p is not None else None
        try:
            return inner_backward(run, inp, tar, noise)
        finally:
            if hook is not None:
                hook.remove()

    def optimizer_step(run, zero_grad: bool = True) -> None:  # noqa: ANN001
        if not isinstance(run, Training):  # the memory planner's trace of a step: not a step
            return inner(run, zero_grad)
        iters = run.progress.iters
        p = None if in_backward else faulty_param(run)
        if p is not None:  # under FSDP, this rank's slice of the gradient
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            with torch.no_grad():
                grad.view(-1)[0] = float("inf")
        inner(run, zero_grad)
        updates = [float(s["step"]) for s in run.optimizer.state.values() if "step" in s]
        record = {"step": iters, "scale": run.scaler.get_scale(),
                  "adam_updates": max(updates, default=0.0)}
        path = Path(record_dir) / f"rank{comm.get_world_rank()}.jsonl"
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    # before the script imports them by name
    step_module.optimizer_step, step_module.forward_backward = optimizer_step, forward_backward
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
