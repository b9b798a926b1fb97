"""One request to a remote model: pick a deployment, send, fail over, relay the answer.

Failover happens only before the client has received a byte: a refused connection, a timeout
before the first event (streams) or the whole response (non-streaming), an HTTP 5xx, 408 or 429,
or a stream that ends or errs before its first event. Each deployment is tried at most once per
request, ``max_attempts`` in all. Any other 4xx is the request's fault: it reaches the client in
the router's envelope with the upstream's status, and is never retried. Once a stream has
started, the client sees whatever happens to it (:mod:`.stream`).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from router.backend import Reply
from router.errors import APIError, BadRequest, Unavailable
from router.params import GenerationParams

from .http import ConnectTimeout, HTTPError, Response
from .balancer import Balancer
from .config import RemoteConfig
from .deadline import Deadline
from .deployment import Deployment
from .errors import RETRYABLE_4XX, blames_request, body_from_json, client_error, error_body, status_of
from .events import EventSplitter
from .forward import extras_used, upstream_body
from .stream import RelayStream, is_error, report_choices, report_usage

log = logging.getLogger("router.remote")

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode

PATHS = {"chat": "/chat/completions", "completions": "/completions", "embeddings": "/embeddings"}


class UpstreamFailure(Exception):
    """One attempt failed in a way another deployment may not: try the next one."""

    def __init__(self, deployment: Deployment, why: str, status: int = 502,
                 retry_after: str | None = None) -> None:
        super().__init__(f"{deployment.name}: {why}")
        self.status = status
        self.retry_after = retry_after


class Relay:
    """Sends requests of one remote model to its deployments."""

    def __init__(self, name: str, config: RemoteConfig, balancer: Balancer,
                 forwardable: frozenset[str]) -> None:
        self.name = name
        self.config = config
        self.balancer = balancer
        self.forwardable = forwardable

    # --- bookkeeping, shared with the streams ----------------------------------------------

    def release(self, d: Deployment) -> None:
        self.balancer.release(d)

    def succeeded(self, d: Deployment) -> None:
        if d.failures:
            log.info("model %s: deployment %s answers again", self.name, d.name)
        self.balancer.succeeded(d)

    def failed(self, d: Deployment, why: str) -> None:
        if self.balancer.failed(d, why):
            log.warning(
                "model %s: deployment %s cools down for %gs after %d failures in a row; last: %s",
                self.name, d.name, self.balancer.cooldown, d.failures, why,
            )
        else:
            log.warning("model %s: deployment %s failed: %s", self.name, d.name, why)

    def _failure(self, d: Deployment, why: str, status: int = 502,
                 retry_after: str | None = None) -> UpstreamFailure:
        self.failed(d, why)
        return UpstreamFailure(d, why, status, retry_after)

    # --- one request ---------------------------------------------------------------------

    async def request(self, endpoint: str, request: Any, params: GenerationParams) -> Reply:
        used = extras_used(request)
        for name in used:
            if name not in self.forwardable:
                raise BadRequest(
                    f"Model `{self.name}` (backend `remote`) cannot honour `{name}`.",
                    param=name, code="unsupported_parameter",
                )
        needs = frozenset(params.requires).union(used)
        path = PATHS[endpoint]
        tried: list[int] = []
        failures: list[UpstreamFailure] = []
        for _ in range(self.config.max_attempts):
            d = self.balancer.pick(tried, needs)
            if d is None:
                break
            tried.append(d.index)
            try:
                body = upstream_body(request, d, stream=params.stream, max_tokens_cap=params.max_tokens_cap)
            except BaseException:
                self.balancer.release(d)
                raise
            try:
                if params.stream:
                    return await self._open_stream(d, path, body, params)
                return await self._post(d, path, body, params.record)
            except UpstreamFailure as failure:
                failures.append(failure)
        raise self._give_up(failures, needs)

    def _give_up(self, failures: list[UpstreamFailure], needs: frozenset[str]) -> APIError:
        if not failures:
            accepting = self.balancer.accepting(needs)
            retry = self.balancer.retry_after(self.config.health_check_interval, accepting)
            extras = sorted(needs - {"logprobs"})
            which = ""
            if len(accepting) < len(self.balancer.deployments) and extras:
                which = " that accepts " + ", ".join(f"`{e}`" for e in extras)
            why = self.balancer.why_unavailable(accepting).removeprefix("no deployment is up: ")
            return Unavailable(
                f"Model `{self.name}` has no deployment available{which}: {why}",
                param="model", code="no_deployment_available",
                headers={"Retry-After": str(retry)},
            )
        summary = "; ".join(str(f) for f in failures)
        n = len(failures)
        message = f"Model `{self.name}`: {n} attempt{'s' if n > 1 else ''} failed: {summary}"
        statuses = {f.status for f in failures}
        if statuses == {429}:
            retry = failures[-1].retry_after or "1"
            return APIError(message, status=429, type="rate_limit_error",
                            code="upstream_rate_limited", headers={"Retry-After": retry})
        if statuses == {504}:
            return APIError(message, status=504, type="server_error", code="upstream_timeout")
        return APIError(message, status=502, type="server_error", code="upstream_error")

    def _check_status(self, d: Deployment, status: int, content: bytes, headers: dict[str, str]) -> None:
        """Raise for a non-200 upstream answer: a failure to fail over on, or the client's 4xx."""
        if status >= 500 or status in RETRYABLE_4XX:
            body = error_body(status, content)
            raise self._failure(d, f"HTTP {status}: {body.message}",
                                429 if status == 429 else 502, headers.get("retry-after"))
        if 400 <= status < 500:
            self.succeeded(d)
            raise client_error(status, error_body(status, content))
        raise self._failure(d, f"unexpected HTTP {status}")

    async def _post(self, d: Deployment, path: str, body: bytes, record: Any) -> bytes:
        resp = None
        try:
            try:
                with Deadline(d.request_timeout):
                    resp = await d.pool.request("POST", d.pool.base_path + path, body=body, headers=d.headers,
                                                connect_timeout=d.connect_timeout)
                    content = await resp.read()
                resp.release()
            except ConnectTimeout as exc:
                raise self._failure(d, str(exc), 504) from None
            except TimeoutError:
                raise self._failure(d, f"no response within {d.request_timeout:g}s", 504) from None
            except HTTPError as exc:
                raise self._failure(d, str(exc)) from None
            if resp.status != 200:
                self._check_status(d, resp.status, content, resp.headers)
            try:
                obj = _decode(content)
            except msgspec.DecodeError:
                obj = None
            if not isinstance(obj, dict):
                raise self._failure(d, "answered 200 with a body that is not a JSON object")
            if is_error(obj):
                self._error_in_body(d, obj)
            d.record_usage(obj.get("usage"))
            report_usage(record, obj.get("usage"))
            report_choices(record, obj.get("choices"), streamed=False)
            obj["model"] = self.name
            self.succeeded(d)
            return _encode(obj)
        except BaseException:
            if resp is not None:
                resp.close()  # cancelled (client gone) or failed: drop the connection
            raise
        finally:
            self.balancer.release(d)

    def _error_in_body(self, d: Deployment, obj: dict[str, Any]) -> None:
        """A 200 (or a stream's first event) that carries an error: the request's fault if its
        code says 4xx, else the deployment's."""
        body = body_from_json(obj, None)
        assert body is not None
        status = status_of(body)
        if blames_request(status):
            self.succeeded(d)
            raise client_error(status, body)  # type: ignore[arg-type]
        raise self._failure(d, f"error: {body.message}", 429 if status == 429 else 502)

    async def _open_stream(self, d: Deployment, path: str, body: bytes,
                           params: GenerationParams) -> RelayStream:
        """Send, then wait for the first event: until then a failure can still fail over."""
        resp = None
        splitter = EventSplitter()
        try:
            try:
                with Deadline(d.first_byte_timeout):
                    resp = await d.pool.request("POST", d.pool.base_path + path, body=body, headers=d.headers,
                                                connect_timeout=d.connect_timeout)
                    if resp.status != 200:
                        self._check_status(d, resp.status, await resp.read(), resp.headers)
                    if not resp.content_type.startswith("text/event-stream"):
                        await self._not_a_stream(d, resp)
                    events: list[bytes] = []
                    while not events:
                        chunk = await resp.readany()
                        if not chunk:
                            raise self._failure(d, "ended the stream before its first event")
                        events = splitter.feed(chunk)
            except ConnectTimeout as exc:
                raise self._failure(d, str(exc), 504) from None
            except TimeoutError:
                raise self._failure(
                    d, f"no first event within {d.first_byte_timeout:g}s", 504
                ) from None
            except HTTPError as exc:
                raise self._failure(d, str(exc)) from None
            first = events[0]
            if first == b"[DONE]":
                raise self._failure(d, "sent `[DONE]` before any event")
            try:
                obj = _decode(first)
            except msgspec.DecodeError:
                obj = None
            if not isinstance(obj, dict):
                raise self._failure(d, "sent a first event that is not a JSON object")
            if is_error(obj):
                self._error_in_body(d, obj)
        except BaseException:
            if resp is not None:
                resp.close()
            self.balancer.release(d)
            raise
        resp.watch_idle(d.read_timeout)
        return RelayStream(
            self, d, resp, splitter, events, self.name, params.include_usage, params.continuous_usage,
            params.record,
        )

    async def _not_a_stream(self, d: Deployment, resp: Response) -> None:
        """A 200 that is not an event stream: an error in disguise, or a broken upstream."""
        content = await resp.read()
        try:
            obj = _decode(content)
        except msgspec.DecodeError:
            obj = None
        if isinstance(obj, dict) and is_error(obj):
            self._error_in_body(d, obj)
        raise self._failure(d, f"answered a stream request with `{resp.content_type}`")
