"""priority: with a model's queue saturated, a priority -10 request sent last starts before the
queued priority-0 requests, on both local engines."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from server import RouterProcess, llamacpp_config, torch_config


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    # The torch engine runs at most 2 sequences at once, so 16 requests queue up.
    config = llamacpp_config("llama") + torch_config("torch", extra="max_num_seqs = 2")
    router = RouterProcess(config, tmp_path_factory.mktemp("priority"))
    yield router
    router.stop()


@pytest.mark.parametrize("model,seats", [("llama", 1), ("torch", 2)])
def test_urgent_request_overtakes_the_queue(narrow, model, seats):
    first_token: dict[str, float] = {}

    async def one(client, name, priority):
        # Long enough that a queued request starting in the instant between our snapshot and
        # the urgent request's arrival is very unlikely.
        body = {"model": model, "messages": [{"role": "user", "content": f"Story {name}"}],
                "max_tokens": 8 if priority else 40,
                "ignore_eos": True, "temperature": 0, "stream": True, "priority": priority}
        async with client.stream("POST", f"{narrow.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if '"content":"' in line and '"content":""' not in line and name not in first_token:
                    first_token[name] = time.monotonic()

    async def main():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
            normal = [asyncio.create_task(one(client, f"n{i}", 0)) for i in range(16)]
            # Saturated: every seat is generating and the rest wait in the queue.
            while len(first_token) < seats or narrow.health()[1]["models"][model]["waiting"] < 8:
                await asyncio.sleep(0.02)
            sent = time.monotonic()
            not_started = {n for n in (f"n{i}" for i in range(16)) if n not in first_token}
            await asyncio.gather(one(client, "urgent", -10), *normal)
            return sent, not_started

    sent, not_started = asyncio.run(main())
    assert len(not_started) >= 8
    urgent = first_token["urgent"]
    overtaken = [n for n in not_started if first_token[n] > urgent]
    assert len(overtaken) == len(not_started), (urgent - sent, sorted(first_token[n] - sent for n in not_started))
