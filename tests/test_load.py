"""Load (not in the default run): 2,000 requests from 64 concurrent clients, streaming and not,
both local engines, 10% of clients leaving early.

    .venv/bin/python -m pytest -m load -s tests/test_load.py      # or: make load
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from loadgen import RssSamples, run_clients
from server import RouterProcess, llamacpp_config, torch_config

pytestmark = pytest.mark.load


def test_two_thousand_mixed_requests(tmp_path):
    config = llamacpp_config("llama") + torch_config("torch", extra="max_num_seqs = 64")
    router = RouterProcess(config, tmp_path)
    try:
        rss = RssSamples(router.proc.pid)
        out = asyncio.run(run_clients(router.url, ["llama", "torch"], 64, total=2000, disconnect_p=0.1,
                                      stream_p=0.5, seed=7, on_tick=rss.tick))
        elapsed = time.monotonic() - rss.start
        time.sleep(2)
        health = router.health()[1]["models"]
        metrics = httpx.get(f"{router.url}/metrics").text
    finally:
        router.stop()
    five_xx = {k: v for k, v in out.counts.items() if k.startswith("5")}
    assert not five_xx and not out.malformed, (out.counts, out.malformed[:3])
    assert out.sent == 2000 and out.counts["ok"] + out.counts["disconnected"] == 2000, out.counts
    for stats in health.values():
        assert stats["running"] == 0 and stats.get("kv_blocks_used", 0) == 0, stats
    first, last, growth = rss.growth_after(60)
    assert growth < 0.05, f"RSS grew {growth:.1%} between the second and the last minute"
    total = sum(float(v) for v in re.findall(r"^router:requests_total{[^}]*} (\S+)$", metrics, re.M))
    assert total == 2000 - out.unsent, (total, out.unsent)  # every request the router saw, once
    print(f"\nload: {dict(out.counts)} ({out.unsent} given up before sending) in {elapsed:.0f}s, rss {first}->{last} kB "
          f"({growth:+.2%})")
