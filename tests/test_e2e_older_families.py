"""End to end: the older families on the torch engine over HTTP (OPT, vLLM's quickstart model,
and GPT-2, both with learned positions; MPT, with ALiBi's biases), with the openai SDK and raw
requests: transformers' greedy tokens, streamed token by token, and a context that ends where the
position table does (MPT's: its max_seq_len)."""

from __future__ import annotations

import httpx
import openai
import pytest

from server import RouterProcess
from torch_models import hf_greedy, tiny_checkpoint


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    root = tmp_path_factory.mktemp("older-e2e")
    folders = {arch: tiny_checkpoint(root / arch, arch) for arch in ("opt", "gpt2", "mpt")}
    # No max_model_len: each model's context is what its position table reaches (512 rows; MPT's max_seq_len).
    config = "".join(f"""
[[models]]
name = "{arch}"
backend = "torch"
path = "{folder}"
kv_cache_gb = 0.02
block_size = 4
""" for arch, folder in folders.items())
    router = RouterProcess(config, root)
    yield router, folders
    router.stop()


@pytest.mark.parametrize("model", ["opt", "gpt2", "mpt"])
def test_streamed_completions_are_transformers_greedy_tokens(router, model):
    router, folders = router
    prompt = [17, 4000, 123, 9, 31000, 77, 5, 2500, 640, 12]
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none")
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(stream)
    tokens = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert tokens == hf_greedy(folders[model], prompt, 12)
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 6  # token by token, not one lump
    assert chunks[-1].usage.prompt_tokens == 10 and chunks[-1].usage.completion_tokens == 12


@pytest.mark.parametrize("model", ["opt", "gpt2", "mpt"])
def test_the_context_is_the_position_tables_length(router, model):
    router, _ = router
    listed = {m["id"]: m for m in httpx.get(f"{router.url}/v1/models").json()["data"]}
    assert listed[model]["max_model_len"] == 512
    r = httpx.post(f"{router.url}/v1/completions", json={"model": model, "prompt": [5] * 510, "max_tokens": 8})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("This model's maximum context length is 512 tokens.")
    ok = httpx.post(f"{router.url}/v1/completions", json={"model": model, "prompt": [5] * 500, "max_tokens": 12,
                                                           "ignore_eos": True}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 12  # positions 500 to 511
