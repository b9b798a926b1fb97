"""End to end: LoRA adapters of torch and llama.cpp models served as models of their own names,
over HTTP with the openai SDK and raw requests."""

from __future__ import annotations

import httpx
import openai
import pytest

from server import GGUF, RouterProcess
from torch_models import hf_greedy, merged_checkpoint, smollm2_folder, tiny_checkpoint, write_lora

ADMIN, POET = "admin-key", "every-only-key"


def router_toml(base, limited_to: str, model: str = "", server: str = "") -> str:
    """An admin key, a key limited to one model, and the tiny model at ``base``."""
    return f"""
[server]
api_keys = ["{ADMIN}"]
{server}

[[keys]]
key = "{POET}"
models = ["{limited_to}"]

[[models]]
name = "tiny"
backend = "torch"
path = "{base}"
max_model_len = 256
kv_cache_gb = 0.02
block_size = 4
{model}
"""


@pytest.fixture(scope="module")
def lora_router(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-e2e")
    base = tiny_checkpoint(root / "tiny", "llama")
    every = write_lora(root / "every", base, seed=3)
    qv = write_lora(root / "qv", base, rank=2, alpha=4.0, targets=("q_proj", "v_proj"), seed=4)
    zero = write_lora(root / "zero", smollm2_folder(), zero_b=True, targets=("q_proj", "down_proj"))
    some = write_lora(root / "some", smollm2_folder(), targets=("v_proj", "up_proj"), seed=5)
    config = router_toml(base, "tiny-every", f'lora_modules = {{ tiny-every = "{every}", tiny-qv = "{qv}" }}') + f"""
[[models]]
name = "smol"
backend = "torch"
path = "{GGUF}"
max_model_len = 512
kv_cache_gb = 0.1
weight_format = "int4"
lora_modules = {{ smol-zero = "{zero}", smol-some = "{some}" }}
"""
    router = RouterProcess(config, root)
    yield router, {"tiny": base, "tiny-every": merged_checkpoint(base, every, root / "every-merged"),
                   "tiny-qv": merged_checkpoint(base, qv, root / "qv-merged")}
    router.stop()


def get(router, path, key=ADMIN):
    return httpx.get(f"{router.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=30)


def post(router, path, body, key=ADMIN):
    return httpx.post(f"{router.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


MESSAGES = [{"role": "user", "content": "Name three colours."}]


def stream_chat(router, model):
    """A greedy streamed chat with the openai SDK: its text and usage; every chunk is named by
    the model asked for."""
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=ADMIN)
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert {c.model for c in chunks} == {model}
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage


def test_models_lists_each_adapter_after_its_parent(lora_router):
    router, _ = lora_router
    cards = get(router, "/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [
        ("tiny", None), ("tiny-every", "tiny"), ("tiny-qv", "tiny"), ("smol", None), ("smol-zero", "smol"),
        ("smol-some", "smol"),
    ]
    card = get(router, "/v1/models/tiny-qv").json()
    assert card["parent"] == "tiny" and card["backend"] == "torch" and card["max_model_len"] == 256
    assert get(router, "/health").status_code == 200


def test_a_key_limited_to_an_adapter_sees_and_uses_only_it(lora_router):
    router, _ = lora_router
    assert [c["id"] for c in get(router, "/v1/models", POET).json()["data"]] == ["tiny-every"]
    body = {"prompt": [5, 6, 7], "max_tokens": 2}
    assert post(router, "/v1/completions", {**body, "model": "tiny-every"}, POET).status_code == 200
    r = post(router, "/v1/completions", {**body, "model": "tiny"}, POET)
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model `tiny` does not exist."


def test_completions_under_each_adapter_match_transformers_with_it_merged(lora_router):
    router, references = lora_router
    prompt = [17, 4000, 123, 9, 31000, 77, 5, 2500, 640, 12]
    for model, folder in references.items():
        body = post(router, "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True,
        }).json()
        assert body["model"] == model
        assert body["choices"][0]["token_ids"] == hf_greedy(folder, prompt, 10), model
    assert len({tuple(hf_greedy(f, prompt, 10)) for f in references.values()}) == 3  # they differ


def test_chat_stream_on_an_adapter_with_the_openai_sdk(lora_router):
    """On the int4 GGUF model (adapter rows added inside the one C call): an adapter whose B is
    zero says what its parent says, token for token; a real one says something else; each chunk
    is named by the model asked for and the usage adds up."""
    router, _ = lora_router
    (base_text, base_usage), (text, usage) = stream_chat(router, "smol"), stream_chat(router, "smol-zero")
    assert text == base_text and len(text) > 10
    assert stream_chat(router, "smol-some")[0] != base_text
    assert usage.prompt_tokens == base_usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    tokens = post(router, "/tokenize", {"model": "smol-zero", "messages": MESSAGES}).json()
    assert tokens["count"] == usage.prompt_tokens


# --- loading and unloading while serving (server.runtime_lora_updating) --------------------


@pytest.fixture(scope="module")
def updating_router(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-runtime")
    base = tiny_checkpoint(root / "tiny", "llama")
    first = write_lora(root / "first", base, seed=6)
    second = write_lora(root / "second", base, rank=2, targets=("o_proj", "down_proj"), seed=7)
    smol = smollm2_folder()
    zero = write_lora(root / "smol-zero", smol, zero_b=True, targets=("q_proj", "k_proj", "down_proj"))
    some = write_lora(root / "smol-some", smol, targets=("q_proj", "v_proj", "up_proj"), seed=8)
    config = router_toml(base, "tiny", server="runtime_lora_updating = true") + f"""
[[models]]
name = "llama"
backend = "llamacpp"
path = "{GGUF}"
n_ctx = 512
lora_modules = {{ llama-zero = "{zero}" }}
"""
    router = RouterProcess(config, root)
    yield router, base, {"first": first, "second": second, "smol-some": some}, root
    router.stop()


def test_adapters_load_and_unload_while_serving(updating_router):
    router, base, folders, root = updating_router
    prompt = [11, 900, 42, 7, 30000, 5, 1234, 99, 4321, 8]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    def tokens(model):
        r = post(router, "/v1/completions", {**body, "model": model})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    load = {"lora_name": "tiny-x", "lora_path": str(folders["first"])}
    r = post(router, "/v1/load_lora_adapter", load)  # two models take adapters: which one?
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "models that take LoRA adapters: `tiny`, `llama`" in r.json()["error"]["message"]
    r = post(router, "/v1/load_lora_adapter", {**load, "model": "tiny"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'tiny-x' added successfully."
    assert r.headers["content-type"].startswith("text/plain")
    assert [(c["id"], c["parent"]) for c in get(router, "/v1/models").json()["data"]] == [
        ("tiny", None), ("tiny-x", "tiny"), ("llama", None), ("llama-zero", "llama")]
    assert tokens("tiny-x") == hf_greedy(merged_checkpoint(base, folders["first"], root / "m1"), prompt, 8)
    again = post(router, "/v1/load_lora_adapter", {**load, "lora_path": str(folders["second"]), "model": "tiny"})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"

    r = post(router, "/v1/unload_lora_adapter", {"lora_name": "tiny-x"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'tiny-x' removed successfully."
    gone = post(router, "/v1/completions", {**body, "model": "tiny-x"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    r = post(router, "/v1/unload_lora_adapter", {"lora_name": "tiny-x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_adapter_not_found"

    # The same name, other weights: their output (no block of the first one's is reused).
    assert post(router, "/v1/load_lora_adapter", {**load, "lora_path": str(folders["second"]),
                                                  "model": "tiny"}).status_code == 200
    assert tokens("tiny-x") == hf_greedy(merged_checkpoint(base, folders["second"], root / "m2"), prompt, 8)
    assert tokens("tiny") == hf_greedy(base, prompt, 8)
    assert "tiny-x" in get(router, "/schema/openapi.json").json()["components"]["schemas"][
        "CompletionRequest"]["properties"]["model"]["enum"]
    assert post(router, "/v1/unload_lora_adapter", {"lora_name": "tiny-x", "lora_int_id": 1}).status_code == 200


@pytest.mark.parametrize("body, status, param, message", [
    ({"lora_name": "x", "lora_path": "/nowhere", "model": "tiny"}, 400, "lora_path", "no adapter_config.json"),
    ({"lora_name": "x", "lora_path": "/nowhere", "model": "llama"}, 400, "lora_path", "no such file or folder"),
    ({"lora_name": "tiny", "lora_path": "/nowhere"}, 400, "lora_name", "`tiny` is already in use"),
    ({"lora_name": "x", "lora_path": "/nowhere", "model": "llama-zero"}, 400, "model", "cannot take LoRA adapters"),
    ({"lora_name": "x", "lora_path": "/nowhere", "model": "nope"}, 404, "model", "does not exist"),
    ({"lora_name": "", "lora_path": "/nowhere"}, 400, "lora_name", None),
    ({"lora_name": "x"}, 400, "lora_path", None),
    ({"lora_name": "x", "lora_path": "/p", "base": "tiny"}, 400, "base", "Unrecognized request argument"),
])
def test_bad_loads_are_4xx_naming_the_field(updating_router, body, status, param, message):
    router = updating_router[0]
    r = post(router, "/v1/load_lora_adapter", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and (message is None or message in error["message"])


def test_llamacpp_adapters_configured_and_loaded_while_serving(updating_router):
    """On the llama.cpp model with the openai SDK: the configured adapter whose B is zero says
    what its parent says, token for token; one loaded at run time says something else, until it
    is unloaded. Each chunk is named by the model asked for and the usage adds up."""
    router, _, folders, _ = updating_router

    def chat(model):
        text, usage = stream_chat(router, model)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        return text

    base_text = chat("llama")
    assert chat("llama-zero") == base_text and len(base_text) > 10
    load = {"lora_name": "llama-some", "lora_path": str(folders["smol-some"]), "model": "llama"}
    assert post(router, "/v1/load_lora_adapter", load).status_code == 200
    assert ("llama-some", "llama") in [(c["id"], c["parent"]) for c in get(router, "/v1/models").json()["data"]]
    some = chat("llama-some")
    assert some != base_text and chat("llama") == base_text
    assert chat("llama-some") == some
    assert post(router, "/v1/unload_lora_adapter", {"lora_name": "llama-some"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        chat("llama-some")


def test_only_a_key_for_every_model_may_load(updating_router):
    router, _, folders, _ = updating_router
    r = post(router, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": str(folders["first"])}, POET)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert post(router, "/v1/unload_lora_adapter", {"lora_name": "y"}, POET).status_code == 403


def test_without_runtime_updating_the_paths_are_404(lora_router):
    router, _ = lora_router
    r = post(router, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": "/p"})
    assert r.status_code == 404
    assert "/v1/load_lora_adapter" not in get(router, "/schema/openapi.json").json()["paths"]
