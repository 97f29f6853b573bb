"""Fixed-shape step programs, fused by ``torch.compile`` and, on CUDA, captured by it.

A decode step on a GPU is bound by its kernels, not by arithmetic: a forward of a
few-million-parameter model runs hundreds of small kernels, and a billion-parameter one
about as many.  A model whose step forwards take tensors of fixed shapes (tree nodes
padded to a :data:`BUCKETS` size, KV-cache slots and lengths given as device tensors)
hands each of them to ``torch.compile`` (:func:`run`): inductor fuses the kernels, and
on CUDA ``mode="reduce-overhead"`` captures each compiled program as a CUDA graph
(PyTorch's cudagraph trees), replayed as one launch.

The compiler is also the proof of capturability.  ``fullgraph=True`` refuses, at the
first call, a program that reads a value on the host or breaks the graph anywhere;
``dynamic=False`` compiles one program per shape, and the menu of shapes is bounded
(the buckets, the CFG rows, the batch sizes); the compiler's guards hold every Python
value a program reads (sampling settings, a stack's options, a model's row count), so a
program never runs with settings other than those it was compiled for.  Tests compile
on the CPU with the ``aot_eager`` backend (``SPECIMG_COMPILE_BACKEND``) and decode under
``torch.compiler.set_stance("fail_on_recompile")``.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch
import torch._dynamo
from torch.utils import _pytree as pytree

from specimg.errors import SpecimgError

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
"""Node counts a step forward is padded to: eight programs cover every tree up to 128 nodes."""

StepMode = Literal["eager", "static", "compiled"]
"""How a model runs its step forwards: ``eager`` (exact shapes; fastest on a CPU),
``static`` (fixed shapes: padded nodes, the whole static cache under a mask: the compiled
programs' arithmetic, run as it is) or ``compiled`` (static, each program compiled)."""
STEP_MODES: tuple[StepMode, ...] = ("eager", "static", "compiled")

Compile = Literal["auto", "on", "off"]
COMPILE: tuple[Compile, ...] = ("auto", "on", "off")

RECOMPILE_LIMIT = 64
"""Programs per function the compiler keeps: 8 buckets x 2 CFG row counts x the batch
sizes and node buckets a batch takes stay below it (dynamo's default, 8, does not)."""

Refused = (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)
"""What the compiler raises for a program it cannot compile whole: a graph break, or a
value read on the host that a shape or a branch depends on."""

F = TypeVar("F", bound=Callable[..., Any])


def bucket(n: int, limit: int) -> int:
    """The smallest bucket that holds ``n`` nodes, never above ``limit`` (the most nodes
    the cache has room for, which is then the last bucket)."""
    size = next((b for b in BUCKETS if b >= n), limit)
    return max(n, min(size, limit))


def step_mode(compile: Compile, device: torch.device, supported: bool) -> StepMode:
    """The step mode ``compile`` asks for on ``device``: "auto" compiles on CUDA and runs
    eagerly elsewhere (on a CPU the compiled AR step is faster, but its compile, a minute
    or more a stack, takes about a hundred demo images to earn back: docs/benchmarks.md),
    "on" compiles wherever the target has fixed-shape steps (an error where it has none),
    "off" never."""
    if compile not in COMPILE:
        raise SpecimgError(f"compile must be one of {', '.join(COMPILE)}, not {compile!r}")
    if compile == "on" and not supported:
        raise SpecimgError("--compile on needs a target with fixed-shape steps (LlamaGen's); this one has none")
    if compile == "on" or (compile == "auto" and supported and device.type == "cuda"):
        return "compiled"
    return "eager"


@functools.cache
def _compiled(fn: F, backend: str, cuda: bool) -> F:
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    mode = "reduce-overhead" if cuda and backend == "inductor" else None
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend, mode=mode)  # type: ignore[return-value]


class CompileClock:
    """Seconds spent compiling, process-wide: the time of every call that compiled a new
    graph (one-off work that no later step pays, which measurements leave out)."""

    seconds = 0.0


def run(fn: Callable[..., Any], *args: Any, compiled: bool) -> Any:
    """``fn(*args)``, compiled (:func:`_compiled`, once per function and backend: inductor, or
    ``SPECIMG_COMPILE_BACKEND``) where ``compiled``.  ``fn`` is a plain function (a method unbound, its object among ``args``), so that one
    program per shape serves every model of a class.  A captured program's next run
    overwrites its outputs, so on CUDA they come back as copies: the caller keeps them."""
    if not compiled:
        return fn(*args)
    cuda = _on_cuda(args)
    program = _compiled(fn, os.environ.get("SPECIMG_COMPILE_BACKEND", "inductor"), cuda)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    begin = time.perf_counter()
    out = program(*args)
    if torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs:
        CompileClock.seconds += time.perf_counter() - begin
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, out) if cuda else out


def _on_cuda(args: tuple[Any, ...]) -> bool:
    """Whether a program's inputs live on CUDA: the device of the first tensor among its arguments' leaves."""
    first = next((a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)), None)
    return first is not None and first.is_cuda


def compiles(model: object) -> bool:
    """Whether ``model`` (a target, a drafter) runs its step programs compiled, and the
    step's own programs with them."""
    return getattr(model, "step_mode", "eager") == "compiled"


class FixedSteps:
    """For a torch module whose step forwards have a fixed-shape form: its step mode, and
    the way it runs a fixed-shape program (:meth:`run_fixed`)."""

    step_mode: StepMode = "eager"

    def set_step_mode(self, mode: StepMode) -> None:
        if mode not in STEP_MODES:
            raise SpecimgError(f"unknown step mode {mode!r}; choose one of {', '.join(STEP_MODES)}")
        self.step_mode = mode

    def run_fixed(self, method: Callable[..., Any], *args: Any) -> Any:
        """``method(self, *args)`` (a fixed-shape program of this model's), compiled in the
        compiled step mode."""
        return run(method, self, *args, compiled=self.step_mode == "compiled")


def static_address(t: torch.Tensor) -> torch.Tensor:
    """``t``, marked as living at one address for its life (a KV cache, a length): on CUDA
    the captured programs read and write it in place rather than copying it in."""
    if t.device.type == "cuda":
        torch._dynamo.mark_static_address(t)
    return t
