"""Choosing a deployment for one request attempt.

Fewest requests in flight wins. Deployments tied on that share the traffic by weight with smooth
weighted round robin (nginx's): equal weights alternate, weights 2:1 give A A B A A B... spread
out rather than bunched. A deployment that is down, cooling, already tried by this request, or
that cannot take every extra the request uses is skipped.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Collection, Sequence

from .deployment import Deployment


class Balancer:
    """Picks deployments and keeps the passive-ejection bookkeeping in one place."""

    def __init__(
        self,
        deployments: Sequence[Deployment],
        *,
        failure_threshold: int,
        cooldown: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deployments = list(deployments)
        self.failure_threshold = failure_threshold
        self.cooldown = cooldown
        self.clock = clock

    def pick(self, tried: Collection[int] = (), needs: frozenset[str] = frozenset()) -> Deployment | None:
        """The deployment for the next attempt, counted as in flight; None if none can take it."""
        now = self.clock()
        best: list[Deployment] = []
        fewest = math.inf
        for d in self.deployments:
            if d.index in tried or not d.available(now) or not needs <= d.accepts:
                continue
            if d.in_flight < fewest:
                fewest = d.in_flight
                best = [d]
            elif d.in_flight == fewest:
                best.append(d)
        if not best:
            return None
        chosen = best[0] if len(best) == 1 else self._round_robin(best)
        chosen.in_flight += 1
        chosen.requests += 1
        return chosen

    @staticmethod
    def _round_robin(tied: list[Deployment]) -> Deployment:
        total = 0
        chosen = tied[0]
        for d in tied:
            d.swrr += d.weight
            total += d.weight
            if d.swrr > chosen.swrr:
                chosen = d
        chosen.swrr -= total
        return chosen

    def release(self, d: Deployment) -> None:
        d.in_flight -= 1

    def succeeded(self, d: Deployment) -> None:
        d.record_success(self.clock())

    def failed(self, d: Deployment, why: str) -> bool:
        """Count a failure; True if the deployment now cools down."""
        return d.record_failure(why, self.clock(), self.failure_threshold, self.cooldown)

    def any_available(self) -> bool:
        now = self.clock()
        return any(d.available(now) for d in self.deployments)

    def accepting(self, needs: frozenset[str]) -> list[Deployment]:
        """Deployments that could take a request needing ``needs``, up or not."""
        return [d for d in self.deployments if needs <= d.accepts]

    def retry_after(self, interval: float, deployments: Sequence[Deployment] | None = None) -> int:
        """Whole seconds until one of ``deployments`` (default: all) may take traffic again:
        the end of the earliest cooldown, or the next health check for one that is down."""
        now = self.clock()
        waits = []
        for d in self.deployments if deployments is None else deployments:
            if d.available(now):
                return 1
            wait = d.cooling_until - now if d.healthy else max(interval, d.cooling_until - now)
            waits.append(wait)
        return max(1, math.ceil(min(waits, default=interval or 1)))

    def why_unavailable(self, deployments: Sequence[Deployment] | None = None) -> str:
        now = self.clock()
        parts = []
        for d in self.deployments if deployments is None else deployments:
            if not d.healthy:
                parts.append(f"{d.name} down ({d.health_error or 'health check failed'})")
            elif now < d.cooling_until:
                parts.append(
                    f"{d.name} cooling for {d.cooling_until - now:.1f}s after {d.failures} "
                    f"failures in a row ({d.last_error})"
                )
        return "no deployment is up: " + "; ".join(parts)
