"""Prometheus metrics, named like vLLM's (``router:`` instead of ``vllm:``).

A small registry of counters, gauges and histograms keyed by label values, rendered in the
Prometheus text format at ``GET /metrics``. Updates are plain dict operations on the event loop
(no locks needed: everything that records runs there). docs/metrics.md lists every metric.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Iterable

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
LOAD_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str, labels: tuple[str, ...]) -> None:
        self.name, self.help, self.label_names = name, help, labels

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        super().__init__(name, help, labels)
        # One-element lists, so that a caller can keep a series' cell (:class:`ModelSeries`).
        self.values: dict[tuple[str, ...], list[float]] = {}

    def cell(self, labels: tuple[str, ...]) -> list[float]:
        cell = self.values.get(labels)
        if cell is None:
            cell = self.values[labels] = [0.0]
        return cell

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self.cell(labels)[0] += amount

    def get(self, labels: tuple[str, ...]) -> float:
        cell = self.values.get(labels)
        return cell[0] if cell else 0.0

    def render(self) -> list[str]:
        return [f"{self.name}{_labels(self.label_names, k)} {_num(v[0])}" for k, v in sorted(self.values.items())]


class Gauge(Metric):
    """A value read when scraped (``fn`` returns label values -> value)."""

    kind = "gauge"

    def __init__(self, name: str, help: str, labels: tuple[str, ...], fn: Callable[[], Iterable[tuple[tuple[str, ...], float]]]) -> None:
        super().__init__(name, help, labels)
        self.fn = fn

    def render(self) -> list[str]:
        return [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in sorted(self.fn())]


class Histogram(Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> None:
        super().__init__(name, help, labels)
        self.buckets = buckets
        self.series: dict[tuple[str, ...], list] = {}  # labels -> [bucket counts..., sum, count]

    def cells(self, labels: tuple[str, ...]) -> list:
        """The series for ``labels``: ``[bucket counts..., sum, count]``, kept by callers."""
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = [0] * len(self.buckets) + [0.0, 0]
        return s

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        observe(self.buckets, self.cells(labels), value)

    def count(self, labels: tuple[str, ...]) -> int:
        s = self.series.get(labels)
        return s[-1] if s else 0

    def render(self) -> list[str]:
        out = []
        for k, s in sorted(self.series.items()):
            cumulative = 0
            for bound, n in zip(self.buckets, s):
                cumulative += n
                le = _labels(self.label_names, k, 'le="' + _num(bound) + '"')
                out.append(f"{self.name}_bucket{le} {cumulative}")
            le = _labels(self.label_names, k, 'le="+Inf"')
            out.append(f"{self.name}_bucket{le} {s[-1]}")
            out.append(f"{self.name}_sum{_labels(self.label_names, k)} {_num(s[-2])}")
            out.append(f"{self.name}_count{_labels(self.label_names, k)} {s[-1]}")
        return out


def observe(buckets: tuple[float, ...], series: list, value: float) -> None:
    """One observation into a histogram series (see :meth:`Histogram.cells`)."""
    i = bisect.bisect_left(buckets, value)
    if i < len(buckets):
        series[i] += 1
    series[-2] += value
    series[-1] += 1


class Registry:
    """All metrics of one app."""

    def __init__(self) -> None:
        self._metrics: list[Metric] = []

    def add(self, metric: Metric) -> Metric:
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for m in self._metrics:
            lines += m.header()
            lines += m.render()
        return "\n".join(lines) + "\n"


MB = ("model", "backend")


class RouterMetrics:
    """The router's metrics; ``gauges`` supplies what is read at scrape time."""

    def __init__(self, gauges: Callable[[str], Iterable[tuple[tuple[str, ...], float]]]) -> None:
        r = self.registry = Registry()
        self.requests = r.add(Counter("router:requests_total", "HTTP requests by model, backend and status code.", MB + ("status",)))
        self.success = r.add(Counter("router:request_success_total", "Finished requests by finish reason.", MB + ("finished_reason",)))
        self.prompt_tokens = r.add(Counter("router:prompt_tokens_total", "Prompt tokens processed (after the chat template).", MB))
        self.generation_tokens = r.add(Counter("router:generation_tokens_total", "Tokens generated.", MB))
        self.cached_tokens = r.add(Counter("router:prompt_tokens_cached_total", "Prompt tokens served from the prefix cache.", MB))
        self.ttft = r.add(Histogram("router:time_to_first_token_seconds", "Time to first token.", MB, LATENCY_BUCKETS))
        self.itl = r.add(Histogram("router:inter_token_latency_seconds", "Time between two streamed events of one request.", MB, LATENCY_BUCKETS))
        self.e2e = r.add(Histogram("router:e2e_request_latency_seconds", "End-to-end request latency.", MB, LATENCY_BUCKETS))
        self.prompt_hist = r.add(Histogram("router:request_prompt_tokens", "Prompt tokens per request.", MB, TOKEN_BUCKETS))
        self.generation_hist = r.add(Histogram("router:request_generation_tokens", "Generated tokens per request.", MB, TOKEN_BUCKETS))
        # The fleet of local models (router/fleet.py).
        self.model_loads = r.add(Counter("router:model_loads_total", "Local models loaded (a worker started and ready).", MB))
        self.load_seconds = r.add(Histogram("router:model_load_seconds", "Time to load a local model.", MB, LOAD_BUCKETS))
        self.model_unloads = r.add(Counter("router:model_unloads_total", "Local models unloaded, by cause: idle (keep_alive), room (memory_limit), admin (POST /models/unload), crash (the worker died).", MB + ("cause",)))
        self.worker_restarts = r.add(Counter("router:worker_restarts_total", "Loads of a local model after its worker crashed.", MB))
        for name, help in (
            ("router:model_memory_bytes", "Memory a local model takes: its worker's resident memory (an estimate while loading, or in the router's process)."),
            ("router:model_loaded", "1 if a local model is loaded, else 0."),
            ("router:num_requests_running", "Requests (sequences for local engines) running."),
            ("router:num_requests_waiting", "Requests waiting: in the router's admission queue and the engine's."),
            ("router:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (torch engine)."),
            ("router:num_preemptions_total", "Sequences preempted for lack of KV memory (torch engine)."),
            ("router:spec_decode_num_drafts_total", "Speculative drafts verified (torch engine, speculative_config)."),
            ("router:spec_decode_num_draft_tokens_total", "Tokens in the speculative drafts verified."),
            ("router:spec_decode_num_accepted_tokens_total", "Draft tokens the model agreed with (kept)."),
            ("router:remote_deployment_up", "1 if a remote deployment takes traffic, else 0."),
            ("router:remote_deployment_in_flight", "Requests in flight to a remote deployment."),
        ):
            labels = MB + (("deployment",) if name.startswith("router:remote") else ())
            r.add(Gauge(name, help, labels, lambda name=name: gauges(name)))

        self._series: dict[tuple[str, str], ModelSeries] = {}

    def series(self, model: str, backend: str) -> "ModelSeries":
        """Every series of one (model, backend) that a request touches, looked up once."""
        key = (model, backend)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = ModelSeries(self, key)
        return found

    def render(self) -> str:
        return self.registry.render()


class ModelSeries:
    """The cells of one (model, backend)'s series: a finished request updates them in place
    instead of looking up ten label tuples (a tenth of the router's own time per relayed
    request went to the metrics)."""

    __slots__ = ("labels", "_metrics", "_status", "_reason", "prompt_tokens", "generation_tokens",
                 "cached_tokens", "ttft", "itl", "e2e", "prompt_hist", "generation_hist")

    def __init__(self, m: RouterMetrics, labels: tuple[str, str]) -> None:
        self.labels = labels
        self._metrics = m
        self._status: dict[int, list[float]] = {}
        self._reason: dict[str, list[float]] = {}
        self.prompt_tokens = m.prompt_tokens.cell(labels)
        self.generation_tokens = m.generation_tokens.cell(labels)
        self.cached_tokens = m.cached_tokens.cell(labels)
        # Histograms as (buckets, cells): ``observe(*series.ttft, value)``.
        self.ttft = (m.ttft.buckets, m.ttft.cells(labels))
        self.itl = (m.itl.buckets, m.itl.cells(labels))
        self.e2e = (m.e2e.buckets, m.e2e.cells(labels))
        self.prompt_hist = (m.prompt_hist.buckets, m.prompt_hist.cells(labels))
        self.generation_hist = (m.generation_hist.buckets, m.generation_hist.cells(labels))

    def request(self, status: int) -> None:
        cell = self._status.get(status)
        if cell is None:
            cell = self._status[status] = self._metrics.requests.cell(self.labels + (str(status),))
        cell[0] += 1

    def success(self, reason: str) -> None:
        cell = self._reason.get(reason)
        if cell is None:
            cell = self._reason[reason] = self._metrics.success.cell(self.labels + (reason,))
        cell[0] += 1
