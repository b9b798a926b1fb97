"""The whole plugin API of the router.

A plugin is a module or object with functions marked ``@hookimpl`` and is found through the
``router`` entry-point group, the same way for the built-ins (``backends.*``, ``plugins.*``) and
for third-party packages::

    [project.entry-points.router]
    my_plugin = "my_package.plugin"

Hooks run at startup, or once per request; never per token. The per-token work is plain method
calls on the objects the hooks registered (engines, backends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

import pluggy

if TYPE_CHECKING:
    from .backend import Backend, ModelInfo
    from .params import GenerationParams

hookspec = pluggy.HookspecMarker("router")
hookimpl = pluggy.HookimplMarker("router")

Endpoint = Literal["chat", "completions"]


@dataclass(frozen=True)
class RequestField:
    """A request field a plugin adds to the wire contract.

    ``type`` is any type msgspec can decode strictly (``int``, ``Annotated[float, Meta(ge=0)]``,
    a ``msgspec.Struct``...). A request that sends the field gets it decoded and validated like
    the core fields; one that does not sees ``default``.
    """

    name: str
    type: Any
    default: Any = None
    endpoints: tuple[Endpoint, ...] = ("chat", "completions")
    description: str = ""


@hookspec
def register_backends(register: Callable[[str, type["Backend"]], None]) -> None:
    """Startup. Register backend types by the name router.toml uses for them.

    Call ``register("torch", TorchBackend)`` once per type. Every implementation runs;
    two plugins registering the same name stop the startup with both names.
    """


@hookspec
def request_fields() -> list[RequestField]:
    """Startup. The extra request fields this plugin accepts.

    Results of all plugins are collected. A field name claimed by two plugins, or by a plugin
    and the core, stops the startup with both names. Unknown fields stay rejected with
    ``Unrecognized request argument supplied``.
    """


@hookspec
def prepare_request(
    request: Any, model: "ModelInfo", params: "GenerationParams", endpoint: Endpoint
) -> None:
    """Once per request, after strict decoding, before the backend sees it.

    Read this plugin's fields from ``request`` and write what they mean into ``params``
    (sampling settings, stop tokens, template switches, priority). Call
    ``params.require(capability, field)`` for what the model must support; the router then
    rejects the request with a 400 naming the field if the model cannot. Raise
    :class:`router.errors.BadRequest` (with ``param``) for a value that is wrong. Every
    implementation runs, in registration order; return values are ignored.
    """


@hookspec
def register_routes() -> list[Any]:
    """Startup. Extra Litestar route handlers to mount on the app. Results are collected."""
