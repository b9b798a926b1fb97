"""One upstream server of a remote model: its settings and its live state.

Two independent signals decide whether a deployment takes traffic:

- active: the health checker's last verdict (``healthy``); a failed check marks it down until a
  check succeeds;
- passive: ``failure_threshold`` failed requests in a row cool it down for ``cooldown`` seconds.
  When the cooldown ends it takes traffic again; its failure count is kept, so one more failure
  cools it down again at once, and one success clears it (a half-open circuit breaker).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from router.config import resolve_secret

from .config import DeploymentConfig, RemoteConfig

ALWAYS_ACCEPTED = frozenset({"logprobs"})
"""Capabilities every OpenAI-compatible upstream has, listed or not."""


@dataclass(eq=False, slots=True)
class Deployment:
    """A deployment's resolved settings plus the counters the balancer and /health read."""

    index: int
    name: str
    url: str
    """Base URL without a trailing slash: ``http://host:port/v1``."""
    weight: int
    upstream_model: str
    forward_extras: frozenset[str]
    """Request fields that may be forwarded to this upstream."""
    accepts: frozenset[str]
    """Capabilities a request may need here: ``forward_extras`` plus :data:`ALWAYS_ACCEPTED`."""
    headers: dict[str, str]
    connect_timeout: float
    first_byte_timeout: float
    read_timeout: float
    request_timeout: float
    health_urls: tuple[str, ...]
    """Where to check health, in order; the first that exists (not 404/405) is kept."""
    max_connections: int | None = None

    in_flight: int = 0
    failures: int = 0
    """Failed requests in a row."""
    cooling_until: float = 0.0
    healthy: bool = True
    health_error: str | None = None
    last_error: str | None = None
    last_success: float = 0.0
    swrr: int = 0
    """Smooth weighted round robin credit, for breaking ties."""
    requests: int = 0
    failed: int = 0
    ejections: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    pool: Any = None
    """The :class:`~backends.remote.http.Pool` of this deployment's connections."""

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.cooling_until

    def state(self, now: float) -> str:
        if not self.healthy:
            return "down"
        if now < self.cooling_until:
            return "cooling"
        return "up"

    def record_success(self, now: float) -> None:
        self.failures = 0
        self.last_success = now

    def record_failure(self, why: str, now: float, threshold: int, cooldown: float) -> bool:
        """Count a failed request; True if this failure started a cooldown."""
        self.failed += 1
        self.failures += 1
        self.last_error = why
        if self.failures >= threshold and now >= self.cooling_until:
            self.cooling_until = now + cooldown
            self.ejections += 1
            return True
        return False

    def record_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int):
                self.prompt_tokens += prompt
            if isinstance(completion, int):
                self.completion_tokens += completion

    def status(self, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "state": self.state(now),
            "url": self.url,
            "weight": self.weight,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "failed": self.failed,
            "failures_in_a_row": self.failures,
            "ejections": self.ejections,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }
        if now < self.cooling_until:
            out["cooling_for_s"] = round(self.cooling_until - now, 1)
        if self.health_error and not self.healthy:
            out["health_error"] = self.health_error
        if self.last_error:
            out["last_error"] = self.last_error
        return out


def build_deployments(config: RemoteConfig) -> list[Deployment]:
    """Resolve each deployment's settings against the model's defaults.

    Reads ``env:`` secrets, so it runs at startup; a missing variable raises ``ValueError``
    naming the key.
    """
    out: list[Deployment] = []
    names: set[str] = set()
    for i, d in enumerate(config.deployments):
        out.append(_build(config, d, i, names))
    return out


def _build(config: RemoteConfig, d: DeploymentConfig, i: int, names: set[str]) -> Deployment:
    parts = urlsplit(d.url)
    origin = f"{parts.scheme}://{parts.netloc}"
    url = d.url.rstrip("/")
    name = d.name or parts.netloc
    if name in names:
        if d.name:
            raise ValueError(f"deployments[{i}].name: `{name}` is used twice")
        name = f"{name}#{i}"
    names.add(name)
    headers = {"content-type": "application/json"}
    key_spec = d.api_key if d.api_key is not None else config.api_key
    if key_spec is not None:
        where = f"deployments[{i}].api_key" if d.api_key is not None else "api_key"
        try:
            headers["authorization"] = f"Bearer {resolve_secret(key_spec)}"
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    path = d.health_check_path or config.health_check_path
    health = (origin + path,) if path else (origin + "/health", url + "/models")
    extras = frozenset(d.forward_extras if d.forward_extras is not None else config.forward_extras)
    return Deployment(
        index=i,
        name=name,
        url=url,
        weight=d.weight,
        upstream_model=d.upstream_model or config.upstream_model or config.name,
        forward_extras=extras,
        accepts=extras | ALWAYS_ACCEPTED,
        headers=headers,
        connect_timeout=d.connect_timeout or config.connect_timeout,
        first_byte_timeout=d.first_byte_timeout or config.first_byte_timeout,
        read_timeout=d.read_timeout or config.read_timeout,
        request_timeout=d.request_timeout or config.request_timeout,
        health_urls=health,
        max_connections=d.max_connections or config.max_connections,
    )
