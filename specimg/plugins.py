"""The plugin manager: loads method plugins from the ``specimg`` entry-point group.

Built-in methods register through the same entry points as third-party packages.  Set
SPECIMG_DISABLE_PLUGIN_AUTOLOAD=1 to load only the built-ins (those of the ``specimg``
distribution itself).  A plugin that fails to import is reported, never fatal.
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
from specimg.methods import AR, Member, MethodSpec, Stack, resolve_stack

ENTRY_POINT_GROUP = "specimg"
DISABLE_AUTOLOAD_ENV = "SPECIMG_DISABLE_PLUGIN_AUTOLOAD"
_BUILTIN_DIST = "specimg"


@attrs.frozen
class PluginInfo:
    """One entry point: its name, the distribution it comes from, and the import error if
    loading it failed."""

    name: str
    source: str
    target: str
    error: str | None = None


class PluginManager:
    def __init__(self, autoload: bool | None = None):
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.pm.register(defaults, name="specimg.defaults")
        self.plugins: list[PluginInfo] = []
        if autoload is None:
            autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "") in ("", "0")
        self.load_entry_points(third_party=autoload)
        self._methods: dict[str, MethodSpec] | None = None

    def load_entry_points(self, third_party: bool = True) -> None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist else "?"
            if not third_party and dist != _BUILTIN_DIST:
                continue
            source = f"{dist} {ep.dist.version}" if ep.dist else "?"
            if self.pm.has_plugin(ep.name):
                continue
            try:
                self.pm.register(ep.load(), name=ep.name)
            except Exception as err:  # a broken plugin must not take the tool down
                self.plugins.append(PluginInfo(ep.name, source, ep.value, f"{type(err).__name__}: {err}"))
                warnings.warn(f"specimg plugin {ep.name!r} ({source}) failed to load: {err}", stacklevel=2)
                continue
            self.plugins.append(PluginInfo(ep.name, source, ep.value))

    def register(self, plugin: object, name: str) -> None:
        """Register a plugin object by hand (tests, notebooks)."""
        self.pm.register(plugin, name=name)
        self.plugins.append(PluginInfo(name, "registered at runtime", repr(plugin)))
        self._methods = None

    @property
    def failed(self) -> list[PluginInfo]:
        return [p for p in self.plugins if p.error]

    def methods(self) -> dict[str, MethodSpec]:
        """Every registered method by name, each bound to the plugin that provides it."""
        if self._methods is None:
            found: dict[str, MethodSpec] = {}
            for impl in self.pm.hook.register_methods.get_hookimpls():
                def register(spec: MethodSpec, _plugin: object = impl.plugin, _name: str = impl.plugin_name) -> None:
                    if spec.name in found or spec.name == AR:
                        raise SpecimgError(f"method {spec.name!r} is registered twice (again by plugin {_name!r})")
                    found[spec.name] = attrs.evolve(spec, plugin=_plugin)

                impl.function(register=register)
            self._methods = found
        return self._methods

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
