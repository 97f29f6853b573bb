"""The plugin manager: loads method plugins from the ``specimg`` entry-point group.

Built-in methods register through the same entry points as third-party packages.  Set
SPECIMG_DISABLE_PLUGIN_AUTOLOAD=1 to load only the built-ins (those of the ``specimg``
distribution itself).  A faulty plugin is reported and left out, never fatal.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pluggy

from specimg import defaults, hookspecs
from specimg.errors import SpecimgError
from specimg.methods import AR, Member, MethodSpec, Stack, check_method_spec, resolve_stack

ENTRY_POINT_GROUP = "specimg"
_BUILTIN_DIST = "specimg"


@attrs.frozen
class PluginInfo:
    """One plugin: its name (the entry point's), where it comes from, what it points at,
    the methods it registers, and why it was left out if it was."""

    name: str
    source: str
    target: str
    methods: tuple[str, ...] = ()
    error: str | None = None


class PluginManager:
    """Loads, checks and indexes method plugins.  A faulty plugin (it fails to import,
    implements a hook specimg does not have, or registers a method name that is taken) is
    left out and listed with its error in ``plugins``, with one warning."""

    def __init__(self, autoload: bool | None = None):
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.pm.register(defaults, name="specimg.defaults")
        self.plugins: list[PluginInfo] = []
        self._methods: dict[str, MethodSpec] = {}
        if autoload is None:
            autoload = os.environ.get("SPECIMG_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0")
        self.load_entry_points(third_party=autoload)

    def load_entry_points(self, third_party: bool = True) -> None:
        """Load the entry points, the built-ins first: a third-party plugin that reuses a
        built-in's method name is the one left out."""
        found = [(ep, ep.dist.name if ep.dist else "?") for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
        for ep, dist in sorted(found, key=lambda item: item[1] != _BUILTIN_DIST):
            if not third_party and dist != _BUILTIN_DIST:
                continue
            info = PluginInfo(ep.name, f"{dist} {ep.dist.version}" if ep.dist else "?", ep.value)
            if self.pm.has_plugin(ep.name):
                self._fail(info, f"the plugin name {ep.name!r} is taken by {self.info(ep.name).source}")
                continue
            try:
                plugin = ep.load()
            except Exception as err:  # a broken plugin must not take the tool down
                self._fail(info, f"{type(err).__name__}: {err}")
                continue
            self._add(plugin, info)

    def register(self, plugin: object, name: str) -> None:
        """Register a plugin object by hand (tests, notebooks); a faulty one is an error."""
        info = self._add(plugin, PluginInfo(name, "registered at runtime", repr(plugin)), warn=False)
        if info.error:
            raise SpecimgError(f"plugin {name!r} is left out: {info.error}")

    def _add(self, plugin: object, info: PluginInfo, warn: bool = True) -> PluginInfo:
        """Register ``plugin``, check its hooks against specimg's and collect its methods;
        on a fault, unregister it and record why."""
        try:
            self.pm.register(plugin, name=info.name)
        except Exception as err:  # pluggy refuses a hook implementation with arguments its spec lacks, over three lines
            return self._fail(info, f"{type(err).__name__}: {' '.join(str(err).split())}", warn)
        try:
            self.pm.check_pending()
            methods = self._collect(plugin)
        except Exception as err:  # a hook specimg lacks, a method refused, or register_methods itself failed
            if isinstance(err, pluggy.PluginValidationError):  # pluggy names a hook specimg lacks with the plugin's repr: name the hook
                unknown = sorted(caller.name for caller in self.pm.get_hookcallers(err.plugin) or () if caller.spec is None)
                fault = f"it implements {', '.join(map(repr, unknown))}, which is not a specimg hook (misspelled?)" if unknown else str(err)
            else:
                fault = str(err) if isinstance(err, SpecimgError) else f"register_methods raised {type(err).__name__}: {err}"
            self.pm.unregister(plugin)
            return self._fail(info, fault, warn)
        self._methods.update(methods)
        info = attrs.evolve(info, methods=tuple(methods))
        self.plugins.append(info)
        return info

    def _collect(self, plugin: object) -> dict[str, MethodSpec]:
        """The methods ``plugin`` registers, each checked against those already known."""
        found: dict[str, MethodSpec] = {}

        def register(spec: MethodSpec) -> None:
            check_method_spec(spec)
            if spec.name == AR:
                raise SpecimgError(f"it registers the method name {AR!r}, which is reserved for plain AR decoding")
            if spec.name in found:
                raise SpecimgError(f"it registers method {spec.name!r} twice")
            owner = self.provider(spec.name)
            if owner is not None:
                raise SpecimgError(f"it registers method {spec.name!r}, which plugin {owner.name!r} ({owner.source}) already provides")
            found[spec.name] = attrs.evolve(spec, plugin=plugin)

        for impl in self.pm.hook.register_methods.get_hookimpls():
            if impl.plugin is plugin:
                impl.function(register=register)
        return found

    def _fail(self, info: PluginInfo, error: str, warn: bool = True) -> PluginInfo:
        info = attrs.evolve(info, error=error)
        self.plugins.append(info)
        if warn:
            warnings.warn(f"specimg plugin {info.name!r} ({info.source}) is left out: {error}", stacklevel=3)
        return info

    @property
    def failed(self) -> list[PluginInfo]:
        return [p for p in self.plugins if p.error]

    def info(self, name: str) -> PluginInfo:
        """The loaded plugin called ``name``."""
        return next(p for p in self.plugins if p.name == name and not p.error)

    def provider(self, method: str) -> PluginInfo | None:
        """The plugin that provides ``method`` (None for an unknown method)."""
        return next((p for p in self.plugins if method in p.methods), None)

    def methods(self) -> dict[str, MethodSpec]:
        """Every registered method by name, each bound to the plugin that provides it."""
        return dict(self._methods)

    def stack(self, method: str, options: Mapping[str, Mapping[str, Any]] | None = None, delta: float | None = None) -> Stack:
        return resolve_stack(method, self.methods(), options, delta)

    def implementers(self, hook: str, members: Sequence[Member]) -> list[str]:
        """The names of ``members`` whose plugin implements ``hook`` (wrappers excluded)."""
        plugins = {id(impl.plugin) for impl in getattr(self.pm.hook, hook).get_hookimpls() if not (impl.wrapper or impl.hookwrapper)}
        return [m.spec.name for m in members if id(m.spec.plugin) in plugins]

    def caller(self, hook: str, keep: list[object], with_defaults: bool) -> pluggy.HookCaller:
        """A caller of ``hook`` restricted to the plugins in ``keep`` (and the core defaults)."""
        keep_ids = {id(p) for p in keep} | ({id(defaults)} if with_defaults else set())
        remove = [p for p in self.pm.get_plugins() if id(p) not in keep_ids]
        return self.pm.subset_hook_caller(hook, remove_plugins=remove)


_default: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide manager, loaded on first use."""
    global _default
    if _default is None:
        _default = PluginManager()
    return _default
