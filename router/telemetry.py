"""Per-request bookkeeping: request ids in every log line, one summary line, metrics.

The app opens a :class:`RequestRecord` for every generation request; the backend reports events
(first token, each streamed event, usage, finish reasons) to it; closing it observes the
histograms and counters and writes one logfmt line. Prompt and completion text are logged only
when the operator turned ``log_content`` on.
"""

from __future__ import annotations

import logging
import os
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .metrics import observe

if TYPE_CHECKING:
    from .metrics import ModelSeries, RouterMetrics

request_id: ContextVar[str] = ContextVar("request_id", default="-")
log = logging.getLogger("router.request")


class RequestIdFilter(logging.Filter):
    """Puts the current request id on every log record (``%(request_id)s``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


def configure_logging(level: str, process: str | None = None) -> None:
    """One handler on stderr for the whole process, each line with its request id; a worker
    process names itself in ``process`` (``worker smollm2``), its lines then read apart."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    where = f" ({process})" if process else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{where} [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def new_request_id(header: str | None) -> str:
    """Honour a sane client ``X-Request-Id``; otherwise make one."""
    if header and len(header) <= 128 and header.isprintable() and " " not in header:
        return header
    return os.urandom(16).hex()  # a random UUID's worth of bits, without building a UUID


@dataclass
class RequestRecord:
    """What one request did, as it happens."""

    metrics: "RouterMetrics"
    request_id: str
    endpoint: str
    model: str = "-"
    backend: str = "-"
    stream: bool = False
    log_content: bool = False
    start: float = field(default_factory=time.monotonic)
    first_event: float | None = None
    last_event: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    closed: bool = False

    _series: "ModelSeries | None" = field(default=None, init=False, repr=False)

    @property
    def series(self) -> "ModelSeries":
        """The metrics series of this request's model. A model name no backend serves is
        counted as ``-``: names a client makes up must not add series without end."""
        found = self._series
        if found is None:
            labels = (self.model, self.backend) if self.backend != "-" else ("-", "-")
            found = self._series = self.metrics.series(*labels)
        return found

    def event(self, text: str = "") -> None:
        """Something reached (or was ready for) the client: the first token, or one more."""
        now = time.monotonic()
        if self.first_event is None:
            self.first_event = now
        else:
            observe(*self.series.itl, now - self.last_event)  # type: ignore[operator]
        self.last_event = now
        if self.log_content and text:
            self.content.append(text)

    def usage(self, prompt: int, completion: int, cached: int = 0) -> None:
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = prompt, completion, cached

    def finished(self, reason: str | None) -> None:
        if reason:
            self.finish_reasons.append(reason)

    def close(self, status: int, prompt_text: str | None = None) -> None:
        """Count it, observe it, log it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        s = self.series
        duration = time.monotonic() - self.start
        s.request(status)
        if status == 200:
            for reason in self.finish_reasons or ["unknown"]:
                s.success(reason)
            s.prompt_tokens[0] += self.prompt_tokens
            s.generation_tokens[0] += self.completion_tokens
            s.cached_tokens[0] += self.cached_tokens
            observe(*s.prompt_hist, self.prompt_tokens)
            observe(*s.generation_hist, self.completion_tokens)
            observe(*s.e2e, duration)
            if self.first_event is not None:
                observe(*s.ttft, self.first_event - self.start)
        if not log.isEnabledFor(logging.INFO):
            return
        ttft = f"{(self.first_event - self.start) * 1000:.1f}" if self.first_event else "-"
        line = (
            f"endpoint={self.endpoint} model={self.model} backend={self.backend} status={status} "
            f"stream={str(self.stream).lower()} prompt_tokens={self.prompt_tokens} "
            f"completion_tokens={self.completion_tokens} cached_tokens={self.cached_tokens} "
            f"finish={','.join(self.finish_reasons) or '-'} ttft_ms={ttft} duration_ms={duration * 1000:.1f}"
        )
        if self.log_content:
            line += f" prompt={prompt_text!r} completion={''.join(self.content)!r}"
        log.info(line)

