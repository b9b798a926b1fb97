"""``/v1/embeddings`` over real HTTP with the openai SDK: all-MiniLM-L6-v2 (the PyPI package's
zipped folder) on the torch backend in its worker, against sentence-transformers' own pipeline on
the same files; bad inputs; concurrent requests sharing forward passes."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from backends.torch.embedder import model_folder
from router.config import resolve_path
from server import RouterProcess, llamacpp_config
from upstreams import remote_model
from workers_util import wait_for

MINILM = "pkg:all_minilm_l6_v2/model.zip"
TEXTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog near the riverbank at dawn.",
         "Embeddings map text to vectors.", "Short.", "Rain, rain, go away; come again another day. " * 5]


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    config = f'[[models]]\nname = "minilm"\nbackend = "torch"\ntask = "embed"\npath = "{MINILM}"\n' + llamacpp_config("chat")
    r = RouterProcess(config, tmp_path_factory.mktemp("embeddings"))
    yield r
    r.stop()


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_folder(resolve_path(MINILM))), device="cpu")


@pytest.fixture(scope="module")
def sdk(router):
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)


def cosines(a, b) -> list[float]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return list((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1))


def post(router, **body) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/embeddings", json={"model": "minilm", **body}, timeout=60)


def test_single_and_batched_inputs_match_sentence_transformers(sdk, reference):
    want = reference.encode(TEXTS)
    one = sdk.embeddings.create(model="minilm", input=TEXTS[1])
    assert len(one.data) == 1 and one.data[0].index == 0 and len(one.data[0].embedding) == 384
    assert cosines([one.data[0].embedding], want[1:2])[0] >= 0.999
    many = sdk.embeddings.create(model="minilm", input=TEXTS)
    assert [d.index for d in many.data] == list(range(len(TEXTS)))
    assert min(cosines([d.embedding for d in many.data], want)) >= 0.999
    assert np.allclose(np.linalg.norm([d.embedding for d in many.data], axis=1), 1.0, atol=1e-5)  # Normalize
    tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert many.usage.prompt_tokens == many.usage.total_tokens == tokens


def test_base64_is_the_same_floats(router):
    floats = post(router, input=TEXTS[:2]).json()["data"]
    packed = post(router, input=TEXTS[:2], encoding_format="base64").json()["data"]
    for f, p in zip(floats, packed):
        assert np.array_equal(np.frombuffer(base64.b64decode(p["embedding"]), dtype="<f4"),
                              np.asarray(f["embedding"], dtype=np.float32))


def test_token_ids_give_the_texts_vectors(router, reference):
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    by_text = [d["embedding"] for d in post(router, input=TEXTS[:3]).json()["data"]]
    by_ids = [d["embedding"] for d in post(router, input=ids).json()["data"]]
    assert min(cosines(by_ids, by_text)) > 0.99999
    (single,) = post(router, input=ids[0]).json()["data"]  # one list of ids is one input
    assert cosines([single["embedding"]], by_text[:1])[0] > 0.99999


def test_a_long_text_is_refused_unless_truncation_is_asked_for(router, reference):
    long = "word " * 400
    r = post(router, input=["fine", long])
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1]" and "256" in r.json()["error"]["message"]
    r = post(router, input=long, truncate_prompt_tokens=-1)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256
    # sentence-transformers cuts to its max_seq_length (256) the same way: its first tokens and [SEP].
    assert cosines([r.json()["data"][0]["embedding"]], reference.encode([long]))[0] >= 0.999


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input[0]"),
    ({"input": ["a", ""]}, "input[1]"),
    ({"input": ["a", [1, 2]]}, "input"),
    ({"input": [[101, 99999999, 102]]}, "input[0]"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": "a", "dimensions": 100}, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "normalize": True}, "normalize"),
    ({}, "input"),
])
def test_bad_inputs_are_400s_naming_the_field(router, body, param):
    r = post(router, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_each_endpoint_refuses_the_other_tasks_models(router):
    r = httpx.post(f"{router.url}/v1/embeddings", json={"model": "chat", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_task"
    assert "`generate`" in r.json()["error"]["message"]
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(f"{router.url}{path}", json={"model": "minilm", **body})
        assert r.status_code == 400, (path, r.text)
        assert "/v1/embeddings" in r.text


def engine_stats(router) -> dict:
    return httpx.get(f"{router.url}/health").json()["models"]["minilm"]


def settled_stats(router) -> dict | None:
    """The engine's stats once two reads a flush apart agree (they reach the router within 0.5 s)."""
    first = engine_stats(router)
    time.sleep(0.7)
    return first if engine_stats(router) == first and "embed_inputs" in first else None


def test_concurrent_requests_share_forward_passes(router, reference):
    post(router, input="warm")
    before = wait_for(lambda: settled_stats(router), what="the engine's stats to settle")
    answers: dict[int, list] = {}

    def client(i: int) -> None:
        texts = [f"{t} ({i})" for t in TEXTS[:4]]
        answers[i] = [texts, post(router, input=texts).json()["data"]]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for texts, data in answers.values():  # each request got its own texts' vectors back
        assert min(cosines([d["embedding"] for d in data], reference.encode(texts))) >= 0.999
    wait_for(lambda: engine_stats(router)["embed_inputs"] - before["embed_inputs"] == 64, what="the stats")
    passes = engine_stats(router)["embed_passes"] - before["embed_passes"]
    assert passes < 16, passes  # 16 requests in fewer forward passes: they were batched together


# --- a remote embedding model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def relay(upstream, tmp_path_factory):
    config = remote_model("relayed", upstream.url, task='"embed"', upstream_model='"up-embed"',
                          health_check_interval="0", max_attempts="1")
    r = RouterProcess(config, tmp_path_factory.mktemp("embeddings_remote"), name="relay")
    yield r
    r.stop()


def test_a_remote_embedding_model_is_relayed(relay, upstream):
    upstream.reset("ok")
    sdk = openai.OpenAI(base_url=f"{relay.url}/v1", api_key="x", max_retries=0)
    got = sdk.embeddings.create(model="relayed", input=["a", "b", "c"], encoding_format="float")
    sent = upstream.hits[-1]
    assert sent["path"] == "/v1/embeddings" and sent["body"] == {"model": "up-embed", "input": ["a", "b", "c"]}
    sdk.embeddings.create(model="relayed", input="a", encoding_format="base64", dimensions=2)
    assert upstream.hits[-1]["body"] == {"model": "up-embed", "input": "a", "encoding_format": "base64", "dimensions": 2}
    assert got.model == "relayed" and [d.embedding[0] for d in got.data] == [0.0, 1.0, 2.0]
    assert got.usage.prompt_tokens == 9
    upstream.reset("500")
    r = httpx.post(f"{relay.url}/v1/embeddings", json={"model": "relayed", "input": "a"})
    assert r.status_code == 502 and "upstream exploded" in r.text
    r = httpx.post(f"{relay.url}/v1/chat/completions", json={"model": "relayed", "messages": [{"role": "user", "content": "a"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_task"
