"""Two ceilings a training step is compared against.

`MatmulCeiling`: one n x n x n `torch.mm` per precision, best of a few calls: what the
machine's matrix units can do on a large, square problem. n is sized to the machine first:
a precision the CPU only emulates (bf16 on an AVX2-only CPU: ~100x slower than fp32) gets a
smaller n, or is skipped, so that the ceiling never dominates a benchmark's time budget.

`ShapeTrueCeiling`: exactly the GEMMs, attention and FFT calls of one training step, at their
real shapes, strides and dtypes, replayed back to back with nothing in between. The model's own
GEMMs are small (K = 192 at the CPU size) and cannot reach the 2048^3 rate, so this is the
ceiling the step can actually reach: step time x fraction = time in the unavoidable kernels.
The calls are recorded from one eager forward and backward of the model being trained (a
`TorchDispatchMode` sees every ATen call below autograd, backward included): for each Linear
y = x W^T the forward x @ W^T and the backward dY @ W and dY^T @ x; each attention call's
forward and backward kernel; each FFT (the AFNO's spectral transforms, forward and
backward); the patch-embedding convolution as the GEMMs it is (its kernel equals its stride:
(B*tokens, C*p*p) @ (C*p*p, D) forward, dY^T @ X for the weight gradient). Everything else a
step runs is elementwise work, whose own limit is bench/floor.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench import clock
from utils.hardware import cpu_precision

aten = torch.ops.aten
GEMM_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
CEILING_SIZES = (2048, 1536, 1024, 768, 512, 256)
KINDS = ("gemm", "attention", "fft")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def precision_label(dtype: torch.dtype, device: torch.device) -> str:
    """fp32 matmuls on a GPU with TF32 enabled run in TF32, a reduced precision the CPU has
    no instructions for is emulated: name it."""
    name = DTYPE_NAMES[dtype]
    if dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "fp32 (TF32 matmuls)"
    if dtype != torch.float32 and device.type == "cpu" and not cpu_precision().is_native(name):
        return f"{name} (emulated)"
    return name


# --------------------------------------------------------------------------- n^3 matmul

class MatmulCeiling:
    """Best-of-`tries` rate of one n x n x n `torch.mm` (2 n^3 FLOPs) per precision, with n
    per precision the largest of CEILING_SIZES (<= `n`) whose call a 256^3 (or, when that
    is fast, 512^3) probe predicts to take at most `max_call_s`; a precision too slow even
    at 256 is skipped."""

    def __init__(self, device: torch.device, dtypes: list[torch.dtype], n: int = 2048,
                 tries: int = 3, max_call_s: float = 0.25):
        self.device, self.tries = device, tries
        self.sizes: dict[torch.dtype, int] = {}
        self.probe: dict[torch.dtype, float] = {}  # GFLOP/s of a 256^3 matmul
        self.skipped: dict[torch.dtype, float] = {}  # dtype -> probe GFLOP/s
        self.operands: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        for dtype in dict.fromkeys(dtypes):
            probe = self.probe[dtype] = self._rate(*self._pair(256, dtype), tries=2)
            if 2 * 512**3 / probe / 1e9 < 0.05:  # fast: a 512^3 probe predicts large n better
                probe = self._rate(*self._pair(512, dtype), tries=2)
            fits = [s for s in CEILING_SIZES if s <= n and 2 * s**3 / probe / 1e9 <= max_call_s]
            if not fits:
                self.skipped[dtype] = probe
                continue
            self.sizes[dtype] = fits[0]
            self.operands[dtype] = self._pair(fits[0], dtype)
            torch.mm(*self.operands[dtype])  # warm-up: first-call set-up is not the ceiling

    def _pair(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(n, n, device=self.device).to(dtype),
                torch.randn(n, n, device=self.device).to(dtype))

    def _rate(self, a: torch.Tensor, b: torch.Tensor, tries: int) -> float:
        best = float("inf")
        for _ in range(tries):
            sync(self.device)
            start = clock.now()
            torch.mm(a, b)
            sync(self.device)
            best = min(best, clock.now() - start)
        return 2 * a.shape[0] ** 3 / best / 1e9

    def gflops(self, dtype: torch.dtype) -> float | None:
        """Measured GFLOP/s now; None for a skipped precision."""
        if dtype not in self.operands:
            return None
        return self._rate(*self.operands[dtype], tries=self.tries)

    def describe(self) -> str:
        parts = [f"{precision_label(d, self.device)} at {n}^3" for d, n in self.sizes.items()]
        parts += [f"{precision_label(d, self.device)} skipped ({r:.1f} GFLOP/s at 256^3: "
                  "too slow for the budget)" for d, r in self.skipped.items()]
        return ", ".join(parts)


# --------------------------------------------------------------------------- recording

@dataclass(frozen=True)
class Spec:
    """A tensor argument: what the replay makes a random stand-in of."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def make(self, device: torch.device) -> torch.Tensor:
        size = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        base = torch.randn(size if self.shape else 1, device=device).to(self.dtype)
        return base.as_strided(self.shape, self.stride)


@dataclass(frozen=True)
class Ref:
    """An argument that is input or output `index` of recorded call `call`: attention's
    backward reads its forward's q, k, v, output and log-sum-exp, so the replayed backward
    gets the replayed forward's tensors and computes what the real one did."""
    call: int
    output: bool
    index: int


@dataclass
class Call:
    op: Any
    kind: str  # "gemm", "attention" or "fft"
    args: tuple
    kwargs: dict
    flops: float = 0.0


def is_attention(op: Any) -> bool:
    name = str(op)
    return "scaled_dot_product" in name or "flash_attention" in name


def is_fft(op: Any) -> bool:
    return "_fft_" in str(op)


def gemm_flops(op: Any, specs: list[Spec]) -> float:
    if op in (aten.mm.default, aten.addmm.default):
        (m, k), (_, n) = specs[-2].shape, specs[-1].shape
        return 2.0 * m * k * n
    if op in (aten.bmm.default, aten.baddbmm.default):
        (b, m, k), (_, _, n) = specs[-2].shape, specs[-1].shape
        return 2.0 * b * m * k * n
    return 0.0


def conv_as_gemms(args: tuple, backward: bool) -> list[Call] | None:
    """A convolution whose kernel equals its stride (patch embedding) as its GEMMs; None for
    any other convolution (it is then replayed as itself)."""
    if backward:
        grad, x, w, _, stride, padding, dilation, transposed, _, groups, mask = args[:11]
    else:
        x, w, _, stride, padding, dilation, transposed, _, groups = args[:9]
    cout, cin, kh, kw = w.shape
    if (list(stride) != [kh, kw] or any(padding) or any(d != 1 for d in dilation)
            or transposed or groups != 1):
        return None
    m = x.shape[0] * (x.shape[2] // kh) * (x.shape[3] // kw)
    k, dt = cin * kh * kw, w.dtype

    def mm(a: tuple[int, int], b: tuple[int, int]) -> Call:
        specs = (Spec(a, (a[1], 1), dt), Spec(b, (b[1], 1), dt))
        return Call(aten.mm.default, "gemm", specs, {}, 2.0 * a[0] * a[1] * b[1])

    if not backward:
        return [mm((m, k), (k, cout))]
    calls = [mm((cout, m), (m, k))] if mask[1] else []  # weight gradient: dY^T @ X
    if mask[0]:
        calls.append(mm((m, cout), (cout, k)))  # input gradient: dY @ W
    return calls


class Recorder(TorchDispatchMode):
    """Records the GEMM, convolution, attention and FFT calls that run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self._refs: dict[tuple, Ref] = {}
        self._keep: list[torch.Tensor] = []  # referenced tensors stay alive: unique addresses

    def _key(self, t: torch.Tensor) -> tuple:
        return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def _arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return self._refs.get(self._key(a)) or Spec(tuple(a.shape), tuple(a.stride()),
                                                         a.dtype)
        if isinstance(a, (list, tuple)):
            return type(a)(self._arg(x) for x in a)
        return a

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (aten.convolution.default, aten.convolution_backward.default):
            gemms = conv_as_gemms(args, backward=func == aten.convolution_backward.default)
            self.calls += gemms if gemms is not None else [
                Call(func, "gemm", self._arg(args), self._arg(kwargs))]
        elif func in GEMM_OPS:
            specs = self._arg(args)
            self.calls.append(Call(func, "gemm", specs, self._arg(kwargs),
                                   gemm_flops(func, [s for s in specs if isinstance(s, Spec)])))
        elif is_attention(func):
            self.calls.append(Call(func, "attention", self._arg(args), self._arg(kwargs)))
            self._remember(args, len(self.calls) - 1, output=False)
            self._remember(out if isinstance(out, (tuple, list)) else (out,),
                           len(self.calls) - 1, output=True)
        elif is_fft(func):
            self.calls.append(Call(func, "fft", self._arg(args), self._arg(kwargs)))
        return out

    def _remember(self, tensors: Any, call: int, output: bool) -> None:
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor) and self._key(t) not in self._refs:
                self._refs[self._key(t)] = Ref(call, output, i)
                self._keep.append(t)


# --------------------------------------------------------------------------- replay

@dataclass
class ShapeTrueCeiling:
    """The recorded calls, with random inputs of the recorded layout, ready to replay."""

    device: torch.device
    calls: list[Call]
    _prepared: list[tuple[Any, tuple, dict]] = field(default_factory=list)

    @classmethod
    def record(cls, fwd_bwd: Callable[[], None], device: torch.device) -> ShapeTrueCeiling:
        """Record the calls `fwd_bwd()` makes (one forward and backward of the eager model)."""
        rec = Recorder()
        with rec:
            fwd_bwd()
        return cls(device, rec.calls)

    def prepare(self) -> ShapeTrueCeiling:
        """Make the random inputs and run every call once (warm-up): needed before
        `seconds` and `split`."""
        inputs: dict[int, tuple] = {}
        outputs: dict[int, tuple] = {}

        def real(a: Any) -> Any:
            if isinstance(a, Spec):
                return a.make(self.device)
            if isinstance(a, Ref):
                return (outputs if a.output else inputs)[a.call][a.index]
            if isinstance(a, (list, tuple)):
                return type(a)(real(x) for x in a)
            return a

        for i, c in enumerate(self.calls):
            args, kwargs = real(c.args), {k: real(v) for k, v in c.kwargs.items()}
            inputs[i] = args
            with torch.no_grad():
                out = c.op(*args, **kwargs)  # also the warm-up call
            outputs[i] = out if isinstance(out, (tuple, list)) else (out,)
            self._prepared.append((c.op, args, kwargs))
        return self

    @property
    def gemm_gflop(self) -> float:
        return sum(c.flops for c in self.calls) / 1e9

    def counts(self) -> dict[str, int]:
        return {k: sum(c.kind == k for c in self.calls) for k in KINDS}

    def seconds(self, tries: int = 2) -> float:
        """Best time of one back-to-back pass over every call."""
        best = float("inf")
        with torch.no_grad():
            for _ in range(tries):
                sync(self.device)
                start = clock.now()
                for op, args, kwargs in self._prepared:
                    op(*args, **kwargs)
                sync(self.device)
                best = min(best, clock.now() - start)
        return best

    def split(self, tries: int = 2) -> dict[str, float]:
        """Best seconds per kind (gemm, attention, fft), each kind replayed on its own."""
        result = {}
        with torch.no_grad():
            for kind in KINDS:
                chosen = [p for p, c in zip(self._prepared, self.calls, strict=True)
                          if c.kind == kind]
                best = float("inf")
                for _ in range(tries):
                    sync(self.device)
                    start = clock.now()
                    for op, args, kwargs in chosen:
                        op(*args, **kwargs)
                    sync(self.device)
                    best = min(best, clock.now() - start)
                result[kind] = best
        return result
