"""Soak (not in the default run): 64 concurrent streams for 2 minutes with random disconnects.

    .venv/bin/python -m pytest -m soak tests/test_soak.py      # SOAK_SECONDS=120 by default
"""

from __future__ import annotations

import asyncio
import os
import re
import time

import httpx
import pytest

from loadgen import RssSamples, run_clients
from server import RouterProcess, llamacpp_config, torch_config

pytestmark = pytest.mark.soak


def metric_sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


def test_soak_64_streams(tmp_path):
    seconds = float(os.environ.get("SOAK_SECONDS", "120"))
    config = (llamacpp_config("llama", extra="max_queue = 24") +
              torch_config("torch", extra="max_num_seqs = 64\nmax_queue = 48"))
    router = RouterProcess(config, tmp_path)
    try:
        rss = RssSamples(router.proc.pid)
        out = asyncio.run(run_clients(router.url, ["llama", "torch"], 64, until=rss.start + seconds,
                                      disconnect_p=0.2, on_tick=rss.tick))
        time.sleep(2)  # disconnected requests finish closing
        metrics = httpx.get(f"{router.url}/metrics").text
        health = router.health()[1]["models"]
    finally:
        router.stop()
    errors = {k: v for k, v in out.counts.items() if k not in ("ok", "disconnected", "429")}
    assert not errors, (out.counts, out.malformed[:3])
    assert out.counts["ok"] > 100
    assert metric_sum(metrics, "router:requests_total") == out.sent
    first, last, growth = rss.growth_after(seconds / 4)
    assert growth < 0.05, f"RSS grew {growth:.1%}: {first} -> {last} kB"
    for stats in health.values():
        assert stats["running"] == 0 and stats.get("kv_blocks_used", 0) == 0
    print(f"\nsoak: {dict(out.counts)} sent={out.sent} rss {first}->{last} kB ({growth:+.2%})")
