"""A batch's images propose their trees side by side, their drafter calls answered together.

Where the core grows EAGLE-2 trees the engine grows a batch's trees together
(``tree.build_dynamic_batch``); a method's own ``propose_tree`` and static trees come here.
Each image builds its tree with the stack's ``propose_tree`` as it would alone, in a thread
of its own, instead of B drafter forwards per level one after another: its drafter is a
stand-in (:class:`LaneDrafter`) whose calls wait until every image still proposing waits
on one, then one batched forward (the drafter's ``batch``) answers them all.  Python runs
one thread at a time, so nothing but the drafter forwards is shared: each image's hooks,
generator and tree are its own, and its drafts are the ones it would make alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from specimg.models.base import Condition

T = TypeVar("T")
Request = tuple[Tensor, Tensor]


class BatchDrafting(Protocol):
    """What a drafter's ``batch(size, cfg)`` returns: the draft state of ``size`` images,
    each call answering several images' requests in one forward."""

    def reset(self, image: int) -> None: ...

    def start(self, requests: Mapping[int, Request]) -> dict[int, Tensor]: ...

    def expand(self, requests: Mapping[int, Request]) -> dict[int, Tensor]: ...


class Lockstep:
    """Runs proposals side by side (:meth:`run`) and batches their drafter calls (:meth:`call`)."""

    def __init__(self, batch: BatchDrafting, pool: ThreadPoolExecutor):
        """``pool``: at least as many threads as images (each proposal holds one while it waits)."""
        self.batch = batch
        self._pool = pool
        self._cond = threading.Condition()
        self._pending: dict[int, tuple[str, Request]] = {}
        self._answers: dict[int, Tensor | BaseException] = {}
        self._proposing: set[int] = set()
        self._aborted = False

    def run(self, jobs: Mapping[int, Callable[[], T]]) -> dict[int, T]:
        """Each image's job (its proposal) in its own thread, under inference mode; their
        results by image.  The first failure (by image) is raised once all have stopped."""
        with self._cond:
            self._proposing, self._aborted = set(jobs), False
        futures = {i: self._pool.submit(self._job, i, job) for i, job in jobs.items()}
        try:
            return {i: future.result() for i, future in futures.items()}
        except BaseException:  # a proposal failed, or the user interrupted: stop the others, then raise it
            with self._cond:
                self._aborted = True
                self._cond.notify_all()
            for future in futures.values():
                future.exception()
            raise

    def _job(self, image: int, job: Callable[[], T]) -> T:
        with torch.inference_mode():  # the answers too: the batch's caches are inference tensors
            try:
                return job()
            finally:
                with self._cond:
                    self._proposing.discard(image)
                    self._answer()

    def call(self, image: int, kind: str, request: Request) -> Tensor:
        """Image ``image``'s drafter call (``start`` or ``expand``), answered with the others'."""
        with self._cond:
            self._pending[image] = (kind, request)
            self._answer()
            while image not in self._answers:
                if self._aborted:
                    raise CancelledError  # another image's proposal failed: this one stops waiting
                self._cond.wait()
            answer = self._answers.pop(image)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _answer(self) -> None:
        """Once every image still proposing waits on a call, answer them (starts first)."""
        while self._pending and set(self._pending) >= self._proposing:
            kind = "start" if any(k == "start" for k, _ in self._pending.values()) else "expand"
            requests = {i: r for i, (k, r) in self._pending.items() if k == kind}
            for i in requests:
                del self._pending[i]
            try:
                self._answers.update(getattr(self.batch, kind)(requests))
            except BaseException as error:  # every waiting image raises it
                self._answers.update(dict.fromkeys(requests, error))
            self._cond.notify_all()


class LaneDrafter:
    """Image ``image``'s drafter in a batch: the drafter's own attributes, its calls
    answered by the lockstep's batched forwards."""

    def __init__(self, lockstep: Lockstep, image: int, drafter: Any):
        self._lockstep, self._image, self._drafter = lockstep, image, drafter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._drafter, name)

    def prefill(self, condition: Condition, cfg: bool) -> None:
        self._lockstep.batch.reset(self._image)

    def start(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        return self._lockstep.call(self._image, "start", (hidden, tokens))

    def expand(self, parents: Tensor, tokens: Tensor) -> Tensor:
        return self._lockstep.call(self._image, "expand", (torch.as_tensor(parents), torch.as_tensor(tokens)))
