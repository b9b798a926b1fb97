"""The plugin manager: built per app, loaded from one entry-point group.

Built-in backends and extras are registered under the ``router`` entry-point group in
pyproject.toml exactly like a third-party package's, so they are found the same way. A plugin that
fails to import is logged and skipped; it never stops the router.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Iterable

import pluggy

from . import hookspecs
from .hookspecs import RequestField

log = logging.getLogger("router.plugins")

GROUP = "router"


class PluginConflict(Exception):
    """Two plugins claim the same backend name or request field."""


@dataclass
class Plugins:
    """A plugin manager plus what its plugins registered at startup."""

    pm: pluggy.PluginManager
    backends: dict[str, type] = field(default_factory=dict)
    backend_owners: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    """Entry points that failed to load, and why."""

    def plugin_name(self, plugin: Any) -> str:
        return self.pm.get_name(plugin) or repr(plugin)

    def request_fields(self) -> list[tuple[str, RequestField]]:
        out: list[tuple[str, RequestField]] = []
        for impl in self.pm.hook.request_fields.get_hookimpls():
            for f in impl.function() or ():
                out.append((impl.plugin_name, f))
        return out

    def routes(self) -> list[Any]:
        return [r for rs in self.pm.hook.register_routes() for r in (rs or ())]


def load_plugins(
    *, entrypoints: bool = True, extra: Iterable[Any] = (), disabled: Iterable[str] = ()
) -> Plugins:
    """Build a plugin manager with the ``router`` entry points (unless ``entrypoints`` is
    false) plus ``extra`` plugin objects, leaving out the names in ``disabled``."""
    pm = pluggy.PluginManager(GROUP)
    pm.add_hookspecs(hookspecs)
    plugins = Plugins(pm)
    disabled = set(disabled)
    if entrypoints:
        seen: set[str] = set()
        for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
            if ep.name in disabled or ep.name in seen:
                continue
            seen.add(ep.name)
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not stop the router
                log.warning("plugin %s (%s) failed to load and is skipped: %s", ep.name, ep.value, exc)
                plugins.skipped[ep.name] = f"{type(exc).__name__}: {exc}"
                continue
            pm.register(plugin, name=ep.name)
    for plugin in extra:
        name = getattr(plugin, "__name__", None) or type(plugin).__name__
        if name not in disabled and pm.get_plugin(name) is None:
            pm.register(plugin, name=name)
    pm.check_pending()
    _collect_backends(plugins)
    return plugins


def _collect_backends(plugins: Plugins) -> None:
    for impl in plugins.pm.hook.register_backends.get_hookimpls():
        owner = impl.plugin_name

        def register(name: str, backend: type, _owner: str = owner) -> None:
            if name in plugins.backends:
                raise PluginConflict(
                    f"backend `{name}` is registered by both plugin "
                    f"`{plugins.backend_owners[name]}` and plugin `{_owner}`"
                )
            plugins.backends[name] = backend
            plugins.backend_owners[name] = _owner

        impl.function(register=register)
