"""LoRA adapters on the llama.cpp engine: PEFT folders converted to llama.cpp's adapter files
(against transformers with the adapter merged in), adapters switched per request with their KV
kept apart, loading and unloading while serving, and the adapters refused (by name)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
import torch

from backends.llamacpp.engine import LlamaCppEngine
from backends.llamacpp.lora import BaseModel, adapter_file, read_safetensors
from backends.peft import AdapterError
from router.engine import EngineRequest, SamplingParams, UnknownAdapter
from torch_models import GGUF, gguf_of, merged_checkpoint, smollm2_folder, tiny_checkpoint, write_lora

PROMPT = [1, 504, 3458, 282, 4649, 314, 2397, 30, 378, 1025, 253, 1345]


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2's shapes, and the Hugging Face folder its GGUF converts to (the reference)."""
    llm = llama_cpp.Llama(model_path=str(GGUF), n_ctx=64, vocab_only=True, verbose=False)
    base = BaseModel.from_metadata(llm.metadata)
    llm.close()
    return base, smollm2_folder()


@pytest.fixture(scope="module")
def adapters(smollm2, tmp_path_factory):
    """Two PEFT adapters of SmolLM2: every projection at r 4; q and v at r 8 with rsLoRA, saved
    in bfloat16."""
    root = tmp_path_factory.mktemp("llamacpp-lora")
    folder = smollm2[1]
    every = write_lora(root / "every", folder, alpha=8.0, seed=5)
    qv = write_lora(root / "qv", folder, rank=8, alpha=4.0, targets=("q_proj", "v_proj"), seed=6, use_rslora=True)
    _to_bfloat16(qv / "adapter_model.safetensors")
    return root, {"every": every, "qv": qv}


def _to_bfloat16(file):
    from safetensors.torch import load_file, save_file

    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(file)).items()}, str(file))


def last_logits(lora: str | None, gguf=GGUF) -> np.ndarray:
    """llama.cpp's logits after PROMPT, from model file ``gguf`` with adapter file ``lora``."""
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=64, n_threads=2, verbose=False, lora_path=lora,
                          logits_all=True)
    try:
        llm.eval(PROMPT)
        return np.array(llm.scores[len(PROMPT) - 1], dtype=np.float64)
    finally:
        llm.close()


def hf_last_logits(folder) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0, -1].double().numpy()


@pytest.mark.parametrize("name", ["every", "qv"])
def test_a_converted_peft_adapter_matches_transformers_with_it_merged(smollm2, adapters, name):
    """llama.cpp runs SmolLM2 from its 4-bit file, transformers from the file dequantized: their
    logits differ by up to ~0.7 without an adapter. With one, they must differ as little, while
    the adapter moves them far more. Measured: without an adapter 0.68 apart; `every` 2.3 apart,
    moved 33 (with the query and key rows left unpermuted, 21 apart); `qv` 1.9 apart, moved 34."""
    base, folder = smollm2
    root, folders = adapters
    file = adapter_file(name, folders[name], base, root)
    assert file.suffix == ".gguf" and file.parent == root
    merged = merged_checkpoint(folder, folders[name], root / f"{name}-merged")
    plain, adapted = last_logits(None), last_logits(str(file))
    reference, reference_base = hf_last_logits(merged), hf_last_logits(folder)
    shift = np.abs(reference - reference_base).max()
    assert np.abs(plain - reference_base).max() < 1.0
    assert shift > 3.0  # the adapter matters
    assert np.abs(adapted - reference).max() < 0.2 * shift
    # transformers' choice with the adapter is llama.cpp's, or ties it: `every` puts two tokens 0.009
    # apart in llama.cpp's AVX2 build, which picks the other (its native build picked this one)
    assert adapted[reference.argmax()] > adapted.max() - 0.05
    assert adapted.argmax() != reference_base.argmax() != reference.argmax()


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    """Tiny random models of each architecture whose PEFT adapters are converted, as Hugging Face
    folders and as float32 GGUF files of the same weights: llama.cpp and transformers give the
    same logits (within 1e-3), so an adapter's conversion is checked closely."""
    root = tmp_path_factory.mktemp("tiny-ggufs")
    made = {}
    for arch in ("llama-plain", "qwen2", "qwen3"):
        folder = tiny_checkpoint(root / arch, arch)
        made[arch] = folder, gguf_of(folder, root / f"{arch}.gguf")
    return made


@pytest.mark.parametrize("arch", ["llama-plain", "qwen2", "qwen3"])
def test_converted_adapters_of_each_architecture_match_transformers_closely(tiny_ggufs, arch, tmp_path):
    """Float32 weights on both sides: llama.cpp with the converted adapter gives transformers'
    logits with it merged, within 2e-3, while the adapter moves them by 1.3-1.9 (Qwen3: its
    head_dim 24 apart from hidden / heads). Measured: at most 9e-4 apart. Pairing a Qwen's query
    and key rows (as a llama's must be), or not pairing a llama's, puts them 0.14-0.6 apart."""
    folder, gguf = tiny_ggufs[arch]
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=64, vocab_only=True, verbose=False)
    base = BaseModel.from_metadata(llm.metadata)
    llm.close()
    assert base.architecture == arch.removesuffix("-plain")
    adapter = write_lora(tmp_path / "adapter", folder, alpha=8.0, seed=7)
    file = adapter_file("a", adapter, base, tmp_path)
    reference = hf_last_logits(merged_checkpoint(folder, adapter, tmp_path / "merged"))
    assert np.abs(last_logits(None, gguf) - hf_last_logits(folder)).max() < 2e-3
    assert np.abs(reference - hf_last_logits(folder)).max() > 0.5  # the adapter matters
    assert np.abs(last_logits(str(file), gguf) - reference).max() < 2e-3


def test_read_safetensors_gives_float32_of_each_float_type(tmp_path):
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {f"t.{d}": torch.randn(3, 5, generator=gen).to(d) for d in (torch.float32, torch.float16, torch.bfloat16)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    read = read_safetensors(tmp_path / "x.safetensors")
    assert set(read) == set(tensors)
    for key, tensor in tensors.items():
        assert read[key].dtype == np.float32 and read[key].shape == (3, 5)
        assert np.array_equal(read[key], tensor.float().numpy()), key
    save_file({"i": torch.arange(4)}, str(tmp_path / "int.safetensors"))
    with pytest.raises(ValueError, match="tensor `i` is I64; F32, F16 and BF16 are read"):
        read_safetensors(tmp_path / "int.safetensors")


# --- the engine ----------------------------------------------------------------------------


def make_engine(adapters=None) -> LlamaCppEngine:
    engine = LlamaCppEngine(str(GGUF), n_ctx=256, n_threads=2, n_threads_batch=2, n_batch=512, adapters=adapters)
    asyncio.run(engine.start())
    return engine


async def generate(engine, adapter, n=8, prompt=PROMPT):
    req = EngineRequest("t", prompt, SamplingParams(temperature=0.0), n, ignore_eos=True, adapter=adapter)
    steps = [s async for s in engine.generate(req)]
    return [t for s in steps for t in s.token_ids], steps[0].cached_tokens


def test_requests_switch_adapters_and_reuse_only_their_own_kv(smollm2, adapters):
    base, _ = smollm2
    root, folders = adapters
    # One adapter as the PEFT folder, the other as the file the same conversion writes.
    kept = root / "kept"
    kept.mkdir()
    gguf = adapter_file("qv-file", folders["qv"], base, kept)
    engine = make_engine({"every": folders["every"], "qv": gguf})
    try:
        order = [None, "every", "every", None, "qv", "every", "qv", None]
        results = [asyncio.run(generate(engine, a)) for a in order]
    finally:
        asyncio.run(engine.stop())
    outputs: dict = {}
    for adapter, (tokens, cached) in zip(order, results):
        outputs.setdefault(adapter, set()).add(tuple(tokens))
    assert all(len(v) == 1 for v in outputs.values()), outputs  # the same answer each time
    assert len({v.pop() for v in outputs.values()}) == 3  # three different ones
    cached = [c for _, c in results]
    # The prompt's KV is reused only right after a request of the same adapter.
    assert cached == [0, 0, len(PROMPT) - 1, 0, 0, 0, 0, 0]

    alone = make_engine({"qv": folders["qv"]})
    try:
        assert asyncio.run(generate(alone, "qv"))[0] == results[4][0]  # as if nothing ran before
    finally:
        asyncio.run(alone.stop())


def test_adapters_load_and_unload_while_serving(adapters, smollm2):
    root, folders = adapters
    engine = make_engine()
    assert "lora_adapters" in engine.capabilities

    async def scenario():
        base_out, _ = await generate(engine, None)
        with pytest.raises(UnknownAdapter):
            await generate(engine, "x")
        await engine.add_adapter("x", folders["every"])
        first, _ = await generate(engine, "x")
        assert first != base_out
        with pytest.raises(AdapterError, match="`x` is already loaded"):
            await engine.add_adapter("x", folders["qv"])

        # Refused while a request generates with it.
        req = EngineRequest("long", PROMPT, SamplingParams(temperature=0.0), 40, ignore_eos=True, adapter="x")
        stream = engine.generate(req)
        await stream.__anext__()
        with pytest.raises(AdapterError, match=r"`x` is serving 1 request\(s\)"):
            await engine.remove_adapter("x")
        rest = [s async for s in stream]
        assert rest[-1].finish_reason == "length"
        await engine.remove_adapter("x")
        with pytest.raises(UnknownAdapter):
            await generate(engine, "x")
        with pytest.raises(AdapterError, match="`x` is not loaded"):
            await engine.remove_adapter("x")

        # The same name with other weights: their output, none of the old adapter's KV.
        await engine.add_adapter("x", folders["qv"])
        second, cached = await generate(engine, "x")
        assert second != first and cached == 0
        # A name is not a file name: "/" and ".." in it are harmless, and no converted file stays.
        await engine.add_adapter("org/../pirate", folders["every"])
        assert (await generate(engine, "org/../pirate"))[0] == first
        assert not any(Path(engine._workdir.name).iterdir())
        assert (await generate(engine, None))[0] == base_out  # the context is back to no adapter

    try:
        asyncio.run(scenario())
    finally:
        asyncio.run(engine.stop())


def _gguf_adapter_of(arch: str, path, tensors=None):
    """A GGUF adapter file of ``arch`` holding ``tensors`` (name: shape), by default one [4, 64]
    and [64, 4] pair for layer 0's query."""
    from gguf import GGUFWriter

    if tensors is None:
        tensors = {"blk.0.attn_q.weight.lora_a": (4, 64), "blk.0.attn_q.weight.lora_b": (64, 4)}
    writer = GGUFWriter(str(path), arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 8.0)
    for name, shape in tensors.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _edited(folder, root, **changes):
    import shutil

    out = root / f"edited-{len(list(root.iterdir()))}"
    shutil.copytree(folder, out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return out


def test_adapters_that_cannot_be_served_are_refused_by_name(adapters, smollm2, tmp_path):
    base, folder = smollm2
    _, folders = adapters
    tiny = write_lora(tmp_path / "tiny-ad", tiny_checkpoint(tmp_path / "tiny", "llama"))
    lm_head = write_lora(tmp_path / "head", folder, targets=("lm_head",))
    cases = [
        (tmp_path / "nowhere", "no such file or folder"),
        (GGUF, "not a LoRA adapter (its general.type must be `adapter`"),
        (_gguf_adapter_of("qwen2", tmp_path / "qwen.gguf"), "an adapter of a `qwen2` model; the base model is `llama`"),
        (tiny, "(r = 4 on this base model)"),
        (lm_head, "weight `base_model.model.lm_head.lora_A.weight`: only the layers' projections"),
        (_edited(folders["every"], tmp_path, use_dora=True), "DoRA (`use_dora`) is not supported"),
        (tmp_path, "no adapter_config.json"),
    ]
    (tmp_path / "text.gguf").write_text("not gguf")
    cases.append((tmp_path / "text.gguf", "not a GGUF file"))
    # A GGUF adapter's tensors must fit the base model's projections (SmolLM2: hidden 576,
    # 3 key-value heads of 64, 30 layers); llama.cpp's own refusal reaches only its log.
    q, v = "blk.3.attn_q.weight", "blk.3.attn_v.weight"
    for i, (tensors, message) in enumerate([
        ({f"{q}.lora_a": (4, 64), f"{q}.lora_b": (64, 4)},  # another llama's adapter
         "`blk.3.attn_q.weight`: lora_a is [4, 64] and lora_b [64, 4]; this base model's weight is [576, 576], "
         "so [r, 576] and [576, r] are expected"),
        ({f"{v}.lora_a": (4, 576), f"{v}.lora_b": (192, 8)}, "lora_a is [4, 576] and lora_b [192, 8]"),  # two ranks
        ({f"{v}.lora_a": (4, 576), f"{v}.lora_b": (576, 4)}, "weight is [192, 576]"),
        ({f"{v}.lora_a": (4, 576)}, "`blk.3.attn_v.weight.lora_a` comes without its pair"),
        ({"blk.30.ffn_up.weight.lora_a": (4, 576), "blk.30.ffn_up.weight.lora_b": (1536, 4)},
         "`blk.30.ffn_up.weight`: the base model has layers 0 to 29"),
        ({"token_embd.weight": (4, 4)}, "it holds no LoRA tensors"),
    ]):
        cases.append((_gguf_adapter_of("llama", tmp_path / f"shape-{i}.gguf", tensors), message))
    for path, message in cases:
        with pytest.raises(AdapterError, match="LoRA adapter `a`") as info:
            adapter_file("a", path, base, tmp_path)
        assert message in str(info.value), (path, str(info.value))
    gemma = BaseModel("gemma2", base.layers, base.hidden, base.intermediate, base.heads, base.kv_heads, base.head_dim)
    with pytest.raises(AdapterError, match="PEFT folders are converted for base models of the llama, qwen2, qwen3 "
                                           "architecture, not `gemma2`; convert it with llama.cpp's convert_lora_to_gguf.py"):
        adapter_file("a", folders["every"], gemma, tmp_path)
    # An adapter file is checked against the projections' shapes only where they are known.
    odd = _gguf_adapter_of("gemma2", tmp_path / "gemma.gguf", {f"{q}.lora_a": (4, 64), f"{q}.lora_b": (64, 4)})
    assert adapter_file("a", odd, gemma, tmp_path) == odd


def test_a_model_whose_adapter_fails_does_not_load(tmp_path):
    with pytest.raises(AdapterError, match="no such file or folder"):
        LlamaCppEngine(str(GGUF), n_ctx=64, n_threads=2, n_threads_batch=2, n_batch=64,
                       adapters={"a": tmp_path / "nowhere"})
