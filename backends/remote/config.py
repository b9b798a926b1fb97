"""The options of a ``remote`` model in router.toml, decoded strictly.

Model-level keys are the defaults of every deployment; a deployment may override the ones that
describe its server (key, model name, extras, timeouts). Every problem is reported with its key
path, like every other model entry.
"""

from __future__ import annotations

import re
from typing import Annotated
from urllib.parse import urlsplit

from msgspec import Meta, Struct

from router.config import ModelConfig

Seconds = Annotated[float, Meta(gt=0)]
ExtraName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
"""A request field (``top_k``) or capability (``structured_outputs``) name."""

_PATH = re.compile(r"^/[^\s?#]*$")


class DeploymentConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """One upstream server of a model: ``[[models.deployments]]``."""

    url: str
    """The upstream's OpenAI base URL, with its ``/v1``: ``http://trt-a:8000/v1``."""
    name: str | None = None
    """Label in /health and the logs (default: ``host:port`` of ``url``)."""
    weight: Annotated[int, Meta(ge=1, le=1000)] = 1
    """Share of the traffic among deployments with equally many requests in flight."""
    api_key: str | None = None
    upstream_model: str | None = None
    forward_extras: list[ExtraName] | None = None
    connect_timeout: Seconds | None = None
    first_byte_timeout: Seconds | None = None
    read_timeout: Seconds | None = None
    request_timeout: Seconds | None = None
    health_check_path: str | None = None
    max_connections: Annotated[int, Meta(ge=1)] | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url `{self.url}` must be http://host[:port]/path or https://...")
        if parts.query or parts.fragment:
            raise ValueError(f"url `{self.url}` must not have a query or fragment")
        if parts.username is not None or parts.password is not None:
            raise ValueError("url must not carry credentials (they would show in /health); use api_key")
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise ValueError(f"url `{self.url}` has an invalid port") from None
        if self.health_check_path is not None and not _PATH.match(self.health_check_path):
            raise ValueError(
                f"health_check_path `{self.health_check_path}` must be a path starting with `/`"
            )


class RemoteConfig(ModelConfig, kw_only=True, forbid_unknown_fields=True):
    """A model served by other OpenAI-compatible servers, reached over HTTP."""

    deployments: Annotated[list[DeploymentConfig], Meta(min_length=1)]
    upstream_model: str | None = None
    """The model name upstreams know (default: this model's ``name``)."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer``; ``env:NAME`` reads the environment at startup."""
    forward_extras: list[ExtraName] = []
    """Vendor extras the upstreams accept; only these are forwarded, others are a 400."""
    connect_timeout: Seconds = 5.0
    first_byte_timeout: Seconds = 60.0
    """Streaming: from sending the request to the upstream's first event."""
    read_timeout: Seconds = 60.0
    """Streaming: the longest silence between two events once the first one arrived."""
    request_timeout: Seconds = 600.0
    """Non-streaming: from sending the request to the whole response."""
    max_attempts: Annotated[int, Meta(ge=1, le=16)] = 3
    """Deployments one request may try (each at most once) before the client gets an error."""
    failure_threshold: Annotated[int, Meta(ge=1)] = 3
    """Failures in a row after which a deployment cools down."""
    cooldown: Seconds = 10.0
    """How long a deployment that failed ``failure_threshold`` times in a row is skipped."""
    health_check_interval: Annotated[float, Meta(ge=0)] = 10.0
    """Seconds between active health checks of each deployment; 0 turns them off."""
    health_check_timeout: Seconds = 5.0
    health_check_path: str | None = None
    """Path on each upstream server to check (default: ``/health``, else ``<url>/models``)."""
    max_connections: Annotated[int, Meta(ge=1)] | None = None
    """Open connections per deployment (default: no limit)."""

    def __post_init__(self) -> None:
        if self.chat_template is not None:
            raise ValueError(
                "chat_template is not used by the remote backend: the upstream applies its own"
            )
        if self.reasoning_parser is not None:
            raise ValueError(
                "reasoning_parser is not used by the remote backend: the upstream splits reasoning "
                "itself (vLLM's --reasoning-parser), and its `reasoning` field is relayed as it is"
            )
        if self.health_check_path is not None and not _PATH.match(self.health_check_path):
            raise ValueError(
                f"health_check_path `{self.health_check_path}` must be a path starting with `/`"
            )
