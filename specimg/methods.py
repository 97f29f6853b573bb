"""Methods, their options and method stacks (``"cascade+lantern"``)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import attrs

from specimg.config import TreeConfig
from specimg.errors import SpecimgError

AR = "ar"
"""The baseline: plain autoregressive decoding, one target forward per token (no plugin)."""


@attrs.frozen
class NoOptions:
    """Options of a method that has none."""


@attrs.frozen
class MethodSpec:
    """A method a plugin provides: its name, its attrs options class (every field with a
    default; a ``delta`` field is the method's total-variation budget per node, unless the
    class also has a ``node_delta`` property, which then is), a one-line description,
    whether it drafts with a drafter (``drafter=False``: its ``propose_tree`` makes every
    tree from the target's own previous outputs, as Jacobi decoding does), option values it
    takes by default when stacked with another method (``stacked_defaults={"sjd": {"mode":
    "paper"}}``: with sjd, gsd is the paper's rule unless the user says otherwise), the
    option values that run its paper as published (``paper``; None: no paper's method) and
    why its defaults depart from them (``departures``), whether its ``build_relaxed_dist``
    takes a batch (``batch=True``: one call relaxes a forest of several images' trees,
    ``DraftTree.forest``; otherwise a batch calls it tree by tree), and the plugin object
    that implements its hooks (set by the manager).  Whether a relaxation compiles as one
    program is the compiler's to say (:meth:`specimg.engine.Engine.relax`)."""

    name: str
    options: type = NoOptions
    description: str = ""
    drafter: bool = True
    stacked_defaults: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    paper: Mapping[str, Any] | None = None
    departures: str = ""
    batch: bool = False
    plugin: object = attrs.field(default=None, eq=False, repr=False)

    def defaults_beside(self, names: list[str]) -> dict[str, Any]:
        """The option values this method takes by default in a stack of ``names``."""
        return {key: value for other in names if other != self.name for key, value in self.stacked_defaults.get(other, {}).items()}

    @property
    def defaults(self) -> Any:
        return self.options()


@attrs.frozen
class Member:
    spec: MethodSpec
    options: Any

    @property
    def delta(self) -> float:
        """The TVD this member may spend per node: ``node_delta`` where its options bound a
        node by more than their ``delta`` (a budget per candidate), else ``delta``."""
        return float(getattr(self.options, "node_delta", getattr(self.options, "delta", 0.0)))

    @property
    def budgeted(self) -> bool:
        """False where the options run a rule with no TVD budget (a paper mode), which
        their ``budgeted`` property says; such a member is held to its own published law."""
        return bool(getattr(self.options, "budgeted", True))


@attrs.frozen
class Stack:
    """Methods applied in order, sharing one total-variation budget ``delta`` per node."""

    members: tuple[Member, ...]
    delta: float

    @property
    def name(self) -> str:
        return "+".join(m.spec.name for m in self.members)

    @property
    def drafter_free(self) -> str | None:
        """The member that drafts without a drafter, if any (its trees come from the target)."""
        return next((m.spec.name for m in self.members if not m.spec.drafter), None)

    @property
    def budgeted(self) -> bool:
        """Whether every node keeps within ``delta`` in TVD (no member runs an unbudgeted rule)."""
        return all(m.budgeted for m in self.members)

    @property
    def unbudgeted(self) -> tuple[str, ...]:
        """The members that run a rule with no TVD budget (held to their papers' laws)."""
        return tuple(m.spec.name for m in self.members if not m.budgeted)

    def released_tree(self, tree: TreeConfig) -> TreeConfig:
        """The tree this stack runs on, given the run's ``tree``: what the first member with
        a ``released_tree`` method on its options makes of it (a paper mode's released
        tree, where the run left the tree to the engine), else ``tree``."""
        for member in self.members:
            chosen = getattr(member.options, "released_tree", None)
            if chosen is not None:
                return chosen(tree)
        return tree

    def options_dict(self) -> dict[str, dict[str, Any]]:
        return {m.spec.name: attrs.asdict(m.options) for m in self.members}


def split_stack(method: str) -> list[str]:
    """``"cascade+lantern++"`` -> ``["cascade", "lantern++"]``: a name may end in "+"."""
    return [name.strip() for name in re.split(r"\+(?=[^+])", method)]


def check_method_spec(spec: MethodSpec) -> None:
    """Refuse a method a stack could not name or whose options cannot be built from defaults."""
    if not isinstance(spec, MethodSpec) or not isinstance(spec.name, str):
        raise SpecimgError(f"it registers {spec!r}, not a MethodSpec with a name")
    if not spec.name.strip() or split_stack(spec.name) != [spec.name]:
        raise SpecimgError(f"it registers the method name {spec.name!r}, which a method string cannot name (a '+' inside, or spaces around it)")
    if not attrs.has(spec.options):
        raise SpecimgError(f"method {spec.name!r}: its options {spec.options!r} are not an attrs class")
    try:
        spec.options()
    except Exception as err:
        raise SpecimgError(f"method {spec.name!r}: its options class cannot be built from its defaults ({err})") from None
    settings = {f"its defaults beside {other!r}": values for other, values in spec.stacked_defaults.items()}
    for what, values in {**settings, "its paper settings": spec.paper or {}}.items():
        try:
            make_options(spec, values)
        except SpecimgError as err:
            raise SpecimgError(f"method {spec.name!r}: {what} are not options it takes ({err})") from None


def paper_rows(spec: MethodSpec) -> list[tuple[str, Any, Any]]:
    """(option, specimg's default, the paper's value) for every option of ``spec``, the
    paper's value being the default where its ``paper`` settings leave the option alone."""
    ours, published = spec.defaults, make_options(spec, spec.paper or {})
    return [(f.name, getattr(ours, f.name), getattr(published, f.name)) for f in attrs.fields(spec.options)]


def parse_options(pairs: list[str] | tuple[str, ...]) -> dict[str, dict[str, str]]:
    """``["cascade.delta=0.3", ...]`` (the CLI's ``-o``) -> ``{"cascade": {"delta": "0.3"}}``."""
    out: dict[str, dict[str, str]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        method, dot, name = key.rpartition(".")
        if not sep or not dot or not method or not name:
            raise SpecimgError(f"option {pair!r} is not of the form method.key=value")
        out.setdefault(method, {})[name] = value
    return out


def make_options(spec: MethodSpec, values: Mapping[str, Any]) -> Any:
    """Build ``spec``'s options from user values (strings from the CLI are converted by
    the field's type); an unknown key or a bad value is a SpecimgError."""
    cls = attrs.resolve_types(spec.options)
    fields = {f.name: f for f in attrs.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            known = ", ".join(fields) or "none"
            raise SpecimgError(f"method {spec.name!r} has no option {key!r} (options: {known})")
        kwargs[key] = _convert(spec.name, key, fields[key].type, value)
    try:
        options = cls(**kwargs)
    except (TypeError, ValueError) as err:  # an attrs validator's error carries the attribute, the allowed values and the value after its message
        message = err.args[0] if err.args and isinstance(err.args[0], str) and err.args[0] else str(err)
        raise SpecimgError(f"bad option for method {spec.name!r}: {message}") from None
    refuse_ignored(spec.name, options, values)
    return options


def refuse_ignored(method: str, options: Any, values: Mapping[str, Any]) -> None:
    """Refuse options given in ``values`` that ``options`` do not use (their ``ignores()``:
    the setting that ignores them, such as ``mode=paper``, and their names): given, they
    would change nothing without a word."""
    setting, ignored = options.ignores() if hasattr(options, "ignores") else ("", ())
    given = [f"{method}.{key}" for key in values if key in ignored]
    if given:
        key = setting.partition("=")[0]
        raise SpecimgError(f"{method}.{setting} does not use {', '.join(given)}: drop {'it' if len(given) == 1 else 'them'}, or set {method}.{key}")


def _convert(method: str, key: str, kind: Any, value: Any) -> Any:
    if not isinstance(value, str) or kind in (str, "str", Any):
        return value
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if kind is int:
            return int(value)
        if kind is float:
            number = float(value)
            if not math.isfinite(number):
                raise ValueError(value)
            return number
    except ValueError:
        kind_name = "finite float" if kind is float else kind.__name__
        raise SpecimgError(f"option {method}.{key}={value!r} is not a valid {kind_name}") from None
    return value


def resolve_stack(
    method: str,
    registry: Mapping[str, MethodSpec],
    options: Mapping[str, Mapping[str, Any]] | None = None,
    delta: float | None = None,
) -> Stack:
    """Turn ``"a+b"`` and per-method option values into a validated Stack.

    The stack's budget is ``delta`` if given, else the largest member delta.
    """
    names = split_stack(method)
    if not all(names):
        raise SpecimgError(f"method {method!r} has an empty member: join method names with '+', as in cascade+lantern")
    options = dict(options or {})
    for name in names:
        if name not in registry:
            installed = ", ".join(sorted(registry)) or "none"
            raise SpecimgError(f"unknown method {name!r} (installed: {installed})")
    if len(set(names)) != len(names):
        raise SpecimgError(f"method {method!r} names a method twice")
    for name in options:
        if name not in names:
            raise SpecimgError(f"options given for {name!r}, which is not in the method stack {method!r}")
    members = tuple(Member(registry[n], make_options(registry[n], {**registry[n].defaults_beside(names), **options.get(n, {})})) for n in names)
    for member in members:
        if not 0.0 <= member.delta <= 1.0:
            raise SpecimgError(f"{member.spec.name}.delta must lie in [0, 1], got {member.delta}")
    if delta is not None and not 0.0 <= delta <= 1.0:
        raise SpecimgError(f"--delta must lie in [0, 1], got {delta}")
    return Stack(members, delta if delta is not None else max(m.delta for m in members))
