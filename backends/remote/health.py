"""Active health checks: ``GET /health`` (or ``<url>/models``) on every deployment, periodically.

A check that does not answer 200 within ``health_check_timeout`` marks the deployment down until a
later check succeeds. Without a configured ``health_check_path`` the checker tries the server's
``/health`` (vLLM, TensorRT-LLM, llama-server, this router) and, where that does not exist (404 or
405: llama-cpp-python's server), the OpenAI ``<url>/models``; the first that exists is kept.

Traffic is better evidence than a probe: a deployment with requests in flight, or one that
answered a request since the last round, is not probed (a single-slot server such as
llama-cpp-python's holds ``/v1/models`` until its running request is done).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Sequence

from .http import HTTPError, describe, target
from .deployment import Deployment

log = logging.getLogger("router.remote")


class HealthChecker:
    """Checks a model's deployments now (:meth:`check_all`) and every ``interval`` (:meth:`run`)."""

    def __init__(self, model: str, deployments: Sequence[Deployment], *, interval: float,
                 timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.deployments = list(deployments)
        self.interval = interval
        self.timeout = timeout
        self.clock = clock
        self._last_round = 0.0

    async def run(self) -> None:
        """Check every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            await self.check_all(skip_busy=True)

    async def check_all(self, *, skip_busy: bool = False) -> None:
        since = self._last_round
        self._last_round = self.clock()
        todo = [
            d for d in self.deployments
            if not (skip_busy and d.healthy and (d.in_flight or d.last_success > since))
        ]
        await asyncio.gather(*(self.check(d) for d in todo))

    async def check(self, d: Deployment) -> bool:
        """Probe one deployment and record the verdict; True if it is healthy."""
        error = None
        urls = d.health_urls
        for i, url in enumerate(urls):
            try:
                async with asyncio.timeout(self.timeout):
                    resp = await d.pool.request("GET", target(url), headers=_auth(d),
                                                connect_timeout=self.timeout)
                    try:
                        await resp.read()
                    finally:
                        resp.release()
                status = resp.status
            except (TimeoutError, HTTPError) as exc:
                error = describe(exc)
                break
            if status in (404, 405) and i + 1 < len(urls):
                continue  # this server has no such endpoint: try the next kind
            if len(urls) > 1:
                d.health_urls = (url,)
            error = None if status == 200 else f"GET {url} answered HTTP {status}"
            break
        self._record(d, error)
        return error is None

    def _record(self, d: Deployment, error: str | None) -> None:
        was = d.healthy
        d.healthy = error is None
        d.health_error = error
        if was and error:
            log.warning("model %s: deployment %s is down: %s", self.model, d.name, error)
        elif not was and not error:
            log.info("model %s: deployment %s is up", self.model, d.name)


def _auth(d: Deployment) -> dict[str, str]:
    key = d.headers.get("authorization")
    return {"authorization": key} if key else {}
