"""Counting the kernel launches of a decoding step, on the CPU, as a GPU would issue them.

On a GPU a step is bound by launches: each device operation issued from Python costs some
10-20 us whatever its size, while a CUDA graph replays a whole forward as one.  Here the
models step at fixed shapes with their graph replays emulated (each one launch, plus the
copies of its inputs into the graph's buffers), host reads take their device forms, and
every ATen call that would run a kernel is counted under the engine's phase of the moment
(draft, verify, relax, accept, commit; "other" outside them, e.g. AR's steps)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from specimg import graphs, lane, stalls

PHASES = ("draft", "verify", "relax", "accept", "commit", "other")

NO_KERNEL = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::detach", "aten::detach_", "aten::lift_fresh",
             "aten::_local_scalar_dense"}
"""Calls that launch no kernel: allocations, detaching, and the host read itself (a
synchronisation, counted where synchronisations are)."""


def launches_kernel(func: Any, args: Any, kwargs: Any, out: Any) -> bool:
    """Whether an ATen call runs a kernel: it writes into a tensor, or it returns a tensor
    that shares no storage with its inputs (a view, a reshape of a contiguous tensor or a
    ``.to`` to the tensor's own dtype returns its input's storage and launches nothing)."""
    if func._schema.name in NO_KERNEL:
        return False
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return True
    storages = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return not outputs or any(t.untyped_storage().data_ptr() not in storages for t in outputs)


OPAQUE_KERNELS = {"aten::multinomial": 12}
"""Calls that run several kernels below the counter's sight (their implementation calls
ATen directly), with the launches each costs on CUDA: one draw of ``torch.multinomial``
checks the distribution (min and max, two comparisons and their and, an asserting
kernel; a sum, a comparison, a not, an asserting kernel), then draws (Exp(1) variates,
a division, an argmax)."""

_SHAPED = "makes a shape from values (a host read on CUDA)"
HOST_BOUND = {
    "aten::_local_scalar_dense": "reads a value on the host", "aten::lift_fresh": "makes a tensor from host data",
    **dict.fromkeys(("aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
                     "aten::bincount", "aten::repeat_interleave", "aten::histc"), _SHAPED),
}
"""Calls a CUDA graph cannot replay: a capture either fails on them or records their
first result for good.  (``Tensor.tolist`` and ``numpy`` read the host below the
dispatcher: a replay refuses them at the Python level.)"""


class NotCapturable(RuntimeError):
    """A function replayed as a graph ran a call no CUDA graph can replay."""


class LaunchCounter(TorchDispatchMode):
    """Kernel launches by phase while active (``with counter:``); inside an emulated graph
    replay nothing is counted but the replay itself, and a call no graph can replay
    (:data:`HOST_BOUND`) raises :class:`NotCapturable`, as a real capture would fail."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.phase = "other"
        self.replaying = False
        self.is_muted = False
        self.is_active = False

    def __enter__(self) -> LaunchCounter:
        self.is_active = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.is_active = False
        super().__exit__(*exc)

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        """Nothing counted and nothing checked inside (a graph's warm-up runs)."""
        outer, self.is_muted = self.is_muted, True
        try:
            yield
        finally:
            self.is_muted = outer

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.is_muted:
            return func(*args, **kwargs)
        if self.replaying and func._schema.name in HOST_BOUND:
            raise NotCapturable(f"a graph replays {func._schema.name}, which {HOST_BOUND[func._schema.name]}")
        out = func(*args, **kwargs)
        if not self.replaying and launches_kernel(func, args, kwargs, out):
            self.counts[self.phase] += OPAQUE_KERNELS.get(func._schema.name, 1)
        return out


def _host_read(counter: LaunchCounter, name: str) -> Callable[..., Any]:
    """``Tensor.<name>`` refused while ``counter`` is active (as the dispatcher's host reads are)."""
    original = getattr(torch.Tensor, name)

    def refuse(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if counter.is_active and not counter.is_muted:
            raise NotCapturable(f"a graph replays Tensor.{name}, which reads values on the host")
        return original(self, *args, **kwargs)
    return refuse


class _Replay:
    """A captured graph as the counter sees it (what :class:`~specimg.graphs.GraphSet`
    keeps in place of a ``torch.cuda.CUDAGraph``): made as GraphSet makes one (its warm-up
    runs outside the capture, uncounted and unchecked, the first finding the inputs it
    reads, then the capture), a replay reruns
    the function on the graph's own input buffers, uncounted but for the one launch, and
    leaves its results in the graph's own outputs."""

    def __init__(self, counter: LaunchCounter, fn: Callable[..., Any], inputs: Any, warmups: int):
        self.counter, self.fn = counter, fn
        with counter.muted():
            self.static = [x.clone() for x in inputs]
            self.reads = graphs.warm_up(fn, self.static, warmups)
        with self._replaying():
            self.outputs = fn(*self.static)

    @contextlib.contextmanager
    def _replaying(self) -> Iterator[None]:
        counter = self.counter
        if not counter.replaying and not counter.is_muted:
            counter.counts[counter.phase] += 1
        outer, counter.replaying = counter.replaying, True
        try:
            with mock.patch.object(torch.Tensor, "tolist", _host_read(counter, "tolist")), mock.patch.object(torch.Tensor, "numpy", _host_read(counter, "numpy")):
                yield
        finally:
            counter.replaying = outer

    def replay(self) -> None:
        with self._replaying():
            for out, new in zip(self.outputs, self.fn(*self.static)):
                out.copy_(new)


@contextlib.contextmanager
def emulated_captures(counter: LaunchCounter) -> Iterator[None]:
    """Every :class:`~specimg.graphs.GraphSet` captures as the counter sees a graph
    (:class:`_Replay`), on any device: a replay reruns the captured function on the
    graph's own inputs, so a result that is not a function of them alone shows, and a
    call no graph can replay raises :class:`NotCapturable` while ``counter`` is active."""

    def capture(self: graphs.GraphSet, fn: Callable[..., Any], inputs: Any, warmups: int) -> tuple[_Replay, Any, Any, list[bool]]:
        graph = _Replay(counter, fn, inputs, warmups)
        return graph, graph.static, graph.outputs, graph.reads

    with mock.patch.object(graphs.GraphSet, "_capture", capture), mock.patch.object(graphs, "capturing", lambda: counter.replaying):
        yield


@contextlib.contextmanager
def graph_path(counter: LaunchCounter, *models: Any) -> Iterator[None]:
    """``models`` (a LlamaGen target, an EAGLE drafter) stepping as on a GPU: at fixed
    shapes, through :class:`~specimg.graphs.GraphSet` with its captures emulated
    (:func:`emulated_captures`; its replays' input copies counted as they run); host reads
    in their device forms; the engine's phases booked to ``counter``.  Engines built inside
    with the default ``cuda_graphs="auto"`` leave the models' step modes as this sets them."""
    enter, leave, outer = lane.Booking.__enter__, lane.Booking.__exit__, []

    def entered(booking: lane.Booking) -> None:
        outer.append(counter.phase)
        counter.phase = booking.phase
        enter(booking)

    def left(booking: lane.Booking, *exc: object) -> None:
        leave(booking, *exc)
        counter.phase = outer.pop()

    with emulated_captures(counter), mock.patch.object(lane.Booking, "__enter__", entered), mock.patch.object(lane.Booking, "__exit__", left), \
            mock.patch.object(stalls, "host_reads_stall", lambda device: True):
        for model in models:
            model.set_step_mode("static")
            model.step_mode = "graphs"  # set_step_mode refuses graphs off CUDA
        yield
