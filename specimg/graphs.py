"""Fixed-shape forwards and their CUDA graphs.

A decode step on a GPU is bound by kernel launches, not by arithmetic: a forward of a
few-million-parameter model and one of a billion cost about the same when each of their
hundreds of kernels waits on Python.  A model whose step forward takes tensors of fixed
shapes (tree nodes padded to a :data:`BUCKETS` size, KV-cache slots given as a tensor)
can be captured once per shape as a CUDA graph and replayed each step: one launch.

:class:`GraphSet` keeps one graph per key (the caller's shape: rows, bucket, ...), captured
on first use from the call's real inputs.  Capture runs the function twice on a side stream
before recording it, so everything the function writes (KV-cache slots) must be written
the same way by a rerun with the same inputs, as a step forward's cache writes are; a
function that moves state for good (a commit) is captured without those runs.  The first
warm-up run also finds which inputs the function reads (:func:`inputs_read`): a replay
copies in only those (a relaxation that never reads the logits does not copy them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from specimg.errors import SpecimgError

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
"""Node counts a step forward is padded to: eight graphs cover every tree up to 128 nodes."""

WARMUP_RUNS = 2
"""Runs of a function before its capture, on its graph's inputs, outside the graph: cuBLAS,
the allocator and whatever the function builds on first use (neighbour tables) settle there."""

StepMode = Literal["eager", "static", "graphs"]
"""How a model runs its step forwards: ``eager`` (exact shapes; fastest on a CPU),
``static`` (fixed shapes: padded nodes, the whole static cache under a mask: the graphs'
arithmetic without the graphs) or ``graphs`` (static, captured and replayed as CUDA graphs)."""
STEP_MODES: tuple[StepMode, ...] = ("eager", "static", "graphs")

CudaGraphs = Literal["auto", "on", "off"]
CUDA_GRAPHS: tuple[CudaGraphs, ...] = ("auto", "on", "off")


def bucket(n: int, limit: int) -> int:
    """The smallest bucket that holds ``n`` nodes, never above ``limit`` (the most nodes
    the cache has room for, which is then the last bucket)."""
    size = next((b for b in BUCKETS if b >= n), limit)
    return max(n, min(size, limit))


def step_mode(cuda_graphs: CudaGraphs, device: torch.device, supported: bool) -> StepMode:
    """The step mode ``cuda_graphs`` asks for on ``device`` ("auto": graphs on CUDA, eager
    elsewhere); "on" where graphs cannot run is an error."""
    if cuda_graphs not in CUDA_GRAPHS:
        raise SpecimgError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}, not {cuda_graphs!r}")
    if cuda_graphs == "off":
        return "eager"
    if device.type == "cuda" and supported:
        return "graphs"
    if cuda_graphs == "on":
        why = "the models are on " + device.type if device.type != "cuda" else "this target has no fixed-shape step"
        raise SpecimgError(f"--cuda-graphs on needs a CUDA target with a fixed-shape step: {why}")
    return "eager"


def capturing() -> bool:
    """Whether a CUDA graph capture is recording now: a graph set then runs its function
    directly, so that a program captured whole (a tree's growth) records the kernels of
    the forwards it calls rather than replaying their graphs inside its own."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capture_seconds(*models: object) -> float:
    """Seconds the models' graph sets have spent capturing so far (0 for a model without)."""
    return sum(getattr(getattr(model, "graphs", None), "capture_seconds", 0.0) for model in models)


class _Reads(TorchDispatchMode):
    """The storages that a run's operations take."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.storages.update(t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor))
        return func(*args, **kwargs)


def inputs_read(fn: Callable[..., Sequence[Tensor]], inputs: Sequence[Tensor]) -> list[bool]:
    """Runs ``fn(*inputs)`` once and tells which of its inputs it reads: an operation takes
    it (or a view of it), or it comes back as an output.  A function a graph can replay
    reads no value on the host, so what it reads depends on its inputs' shapes alone."""
    with _Reads() as reads:
        outputs = fn(*inputs)
    touched = reads.storages | {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(outputs) if isinstance(t, Tensor)}
    return [x.untyped_storage().data_ptr() in touched for x in inputs]


def warm_up(fn: Callable[..., Sequence[Tensor]], inputs: Sequence[Tensor], runs: int) -> list[bool]:
    """``runs`` runs of ``fn(*inputs)`` before a capture, the first finding which inputs it
    reads (:func:`inputs_read`); every input counts as read where none runs."""
    if not runs:
        return [True] * len(inputs)
    reads = inputs_read(fn, inputs)
    for _ in range(runs - 1):
        fn(*inputs)
    return reads


class FixedSteps:
    """For a torch module whose step forwards have a fixed-shape form: its step mode and its
    graphs (which a subclass must clear whenever a buffer they read is reallocated)."""

    step_mode: StepMode = "eager"
    graphs: GraphSet

    def set_step_mode(self, mode: StepMode) -> None:
        if mode not in STEP_MODES:
            raise SpecimgError(f"unknown step mode {mode!r}; choose one of {', '.join(STEP_MODES)}")
        device = next(self.parameters()).device  # type: ignore[attr-defined]
        if mode == "graphs" and device.type != "cuda":
            raise SpecimgError(f"CUDA graphs need the model on a CUDA device, not {device.type}")
        self.step_mode = mode

    def current_graphs(self) -> GraphSet:
        """Its graphs, as the step about to run may use them (a subclass clears them first
        where a tensor they read was made anew)."""
        return self.graphs

    def replay_program(
        self, key: tuple[Hashable, ...], program: Callable[..., Sequence[Tensor]], inputs: Sequence[Tensor],
        host: tuple[Callable[[], Hashable], Callable[[Hashable], None]],
    ) -> Sequence[Tensor]:
        """``program``, which calls this model's step forwards, replayed as one CUDA graph per
        ``key`` on the graph path (:meth:`GraphSet.run_program`, ``host`` the state it moves):
        inside the capture the forwards record their kernels, not their own graphs."""
        if self.step_mode != "graphs":
            raise RuntimeError("replay needs the graph step mode (Engine(cuda_graphs='on'))")
        return self.current_graphs().run_program(key, program, inputs, host)


class GraphSet:
    """CUDA graphs of one function, one per key, sharing one memory pool.  ``run`` returns
    the graph's own output tensors: the next replay overwrites them, so a caller that keeps
    them across calls must copy them."""

    def __init__(self) -> None:
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Sequence[Tensor], Sequence[Tensor], list[bool]]] = {}  # graph, inputs, outputs, which inputs it reads
        self._pool: object | None = None
        self._host_after: dict[Hashable, Hashable] = {}  # per program (:meth:`run_program`): the host state its capture's run left
        self.capture_seconds = 0.0
        """Total time spent capturing (the warm-up runs included)."""

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._host_after.clear()
        self._pool = None

    def run(self, key: Hashable, fn: Callable[..., Sequence[Tensor]], inputs: Sequence[Tensor], warmups: int = WARMUP_RUNS) -> Sequence[Tensor]:
        """``fn(*inputs)``, replayed from the key's graph (captured on first use after
        ``warmups`` runs: 0 for a function that a rerun would not leave as one run does,
        such as a commit that moves cache entries and lengths for good)."""
        if capturing():  # inside another graph's capture: that graph records this call's kernels
            return fn(*inputs)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(fn, inputs, warmups)  # replayed once: this call
            return entry[2]
        graph, static, outputs, reads = entry
        for buffer, value, read in zip(static, inputs, reads):
            if read:
                buffer.copy_(value, non_blocking=True)
        graph.replay()
        return outputs

    def run_program(
        self, key: tuple[Hashable, ...], program: Callable[..., Sequence[Tensor]], inputs: Sequence[Tensor],
        host: tuple[Callable[[], Hashable], Callable[[Hashable], None]],
    ) -> Sequence[Tensor]:
        """:meth:`run` for a program that also moves host state (``host``: its getter and
        setter; a drafter's count of fed nodes), one graph per key and starting state (the
        key's last item).  Every run (warm-ups, capture) starts from the state before the
        first, and after a replay, which runs no Python, the state is set as the capture's
        run left it."""
        get, put = host
        before = get()
        entry = (*key, before)

        def recorded(*args: Tensor) -> Sequence[Tensor]:
            put(before)
            outputs = program(*args)
            self._host_after[entry] = get()
            return outputs

        outputs = self.run(entry, recorded, inputs)
        put(self._host_after[entry])
        return outputs

    def _capture(
        self, fn: Callable[..., Sequence[Tensor]], inputs: Sequence[Tensor], warmups: int
    ) -> tuple[torch.cuda.CUDAGraph, Sequence[Tensor], Sequence[Tensor], list[bool]]:
        begin = time.perf_counter()
        static = [x.clone() for x in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            reads = warm_up(fn, static, warmups)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = fn(*static)
        graph.replay()
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - begin
        return graph, static, outputs, reads
