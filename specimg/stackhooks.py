"""A method stack's hooks, bound once to the members that implement them and to their
options: what the engine calls every step and the drafter trainer every batch, so neither
looks hooks up by name nor carries their options alongside."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from specimg.errors import SpecimgError
from specimg.methods import Stack
from specimg.plugins import PluginManager


@attrs.frozen
class FirstResult:
    """A firstresult hook (propose_tree, score, accept): the one member that implements it
    (``owner``; None: the core's default alone), called with that member's options where
    the hook takes options.  ``accept`` calls the member alone, None where it passes: the
    engine then runs the core's rule itself (for a batch, on every tree at once)."""

    caller: Callable[..., Any] = attrs.field(repr=False)
    owner: str | None
    options: Any
    takes_options: bool

    def __call__(self, **kwargs: Any) -> Any:
        if self.takes_options:
            kwargs["options"] = self.options
        return self.caller(**kwargs)


@attrs.frozen
class MemberHook:
    """One member's implementation of a folded hook (build_relaxed_dist, train_loss), with
    its budget, its options and whether it takes a batch (``MethodSpec.batch``): calling it
    passes the keyword arguments through and returns the member's result, None when it
    passes."""

    method: str
    delta: float
    caller: Callable[..., Any] = attrs.field(repr=False)
    options: Any
    batch: bool = False

    def __call__(self, **kwargs: Any) -> Any:
        results = self.caller(**kwargs, options=self.options)
        return next((r for r in results if r is not None), None)


@attrs.frozen
class StackHooks:
    """Every hook of one stack; folded hooks in method-string order."""

    propose: FirstResult
    score: FirstResult
    accept: FirstResult
    relaxers: tuple[MemberHook, ...]
    train_losses: tuple[MemberHook, ...]

    @classmethod
    def bind(cls, plugins: PluginManager, stack: Stack) -> StackHooks:
        """Bind ``stack``'s hooks; two members that implement one firstresult hook are an error."""
        return cls(
            propose=_first_result(plugins, stack, "propose_tree"),
            score=_first_result(plugins, stack, "score"),
            accept=_first_result(plugins, stack, "accept", with_defaults=False),
            relaxers=_member_hooks(plugins, stack, "build_relaxed_dist"),
            train_losses=_member_hooks(plugins, stack, "train_loss"),
        )


def _first_result(plugins: PluginManager, stack: Stack, hook: str, with_defaults: bool = True) -> FirstResult:
    owners = plugins.implementers(hook, stack.members)
    if len(owners) > 1:
        raise SpecimgError(f"methods {owners[0]!r} and {owners[1]!r} both implement {hook!r}; stack at most one of them")
    member = next((m for m in stack.members if m.spec.name in owners), None)
    caller = plugins.caller(hook, [m.spec.plugin for m in stack.members], with_defaults=with_defaults)
    takes_options = "options" in getattr(plugins.pm.hook, hook).spec.argnames
    return FirstResult(caller, member.spec.name if member else None, member.options if member else None, takes_options)


def _member_hooks(plugins: PluginManager, stack: Stack, hook: str) -> tuple[MemberHook, ...]:
    return tuple(
        MemberHook(m.spec.name, m.delta, plugins.caller(hook, [m.spec.plugin], with_defaults=False), m.options, m.spec.batch)
        for m in stack.members
        if plugins.implementers(hook, [m])
    )
