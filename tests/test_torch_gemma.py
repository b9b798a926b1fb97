"""Gemma 1, 2 and 3 on the torch engine: greedy output and prompt logprobs against transformers
(float32), the C step against the packed torch path (int8, int4), the image-text Gemma 3
checkpoint's language model, and what the configs say."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from backends.torch.loader import _language_model_weight, _safetensors_weights
from backends.torch.model import ModelError, ModelSpec
from router.engine import EngineRequest, SamplingParams
from test_torch_engine import assert_greedy_matches_transformers, engine_for, random_prompts, run, small_steps_engine
from test_torch_packed import counting_decoder
from torch_models import _hf_model, hf_auto_class, tiny_checkpoint

ARCHS = ["gemma", "gemma2", "gemma3", "gemma3-mm"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    return {arch: tiny_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_alone_and_in_a_mixed_batch(checkpoints, arch):
    # gemma: GeGLU, 1 + weight norms, embeddings times sqrt(48); gemma2: norms of both blocks'
    # outputs, a window of 8 on layer 0, scores capped at 2 and logits at 6, query_pre_attn_scalar
    # 64 (not head_dim 16); gemma3: query and key norms, the sliding layer rotating with base 1e4,
    # the full one with 1e6 stretched 8x; gemma3-mm: the same inside an image-text checkpoint.
    assert_greedy_matches_transformers(checkpoints[arch])


async def prompt_logprobs(engine, prompt):
    req = EngineRequest("p", prompt, SamplingParams(temperature=0.0), 1, ignore_eos=True, prompt_logprobs=0)
    async for step in engine.generate(req):
        return [entry.logprob for entry in step.prompt_logprobs]


def engine_prompt_logprobs(folder, dtype=torch.float32):
    """A 60-token prompt and the engine's logprobs of it (16-token steps over blocks of 4, in
    ``dtype``)."""
    prompt = random_prompts(7, (60,))[0]
    engine = engine_for(folder, block_size=4, max_batched_tokens=16, dtype=str(dtype).removeprefix("torch."))
    try:
        return prompt, run(prompt_logprobs(engine, prompt))
    finally:
        run(engine.stop())


def assert_prompt_logprobs_match_transformers(folder, dtype, within):
    """:func:`engine_prompt_logprobs` within ``within`` of transformers' forward pass in ``dtype``."""
    prompt, got = engine_prompt_logprobs(folder, dtype)
    assert distance(got, hf_prompt_logprobs(folder, prompt, dtype)) < within


def hf_prompt_logprobs(folder, prompt, dtype=torch.float32, **config):
    """transformers' forward over the prompt (float32 unless ``dtype``): each next prompt token's
    logprob. ``config``: changes to the checkpoint's config (what the engine must not ignore)."""
    model = _hf_model(folder) if not config and dtype == torch.float32 else hf_auto_class(folder).from_pretrained(
        str(folder), dtype=dtype, local_files_only=True, **config
    )
    with torch.no_grad():
        lp = model(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    return lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


def distance(a, b):
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("arch,blocks", [(arch, False) for arch in ARCHS] + [("gemma2", True)])
def test_prompt_logprobs_match_transformers(checkpoints, arch, blocks, monkeypatch):
    # Greedy tokens cannot see a cap on the logits (tanh keeps their order); logprobs see every
    # factor. A 40-token prompt in three chunks, the last ones over the window of 8. blocks: the
    # capped prefill's rows a few at a time (as a long context takes them).
    if blocks:
        monkeypatch.setattr("backends.torch.attention.CAPPED_SCORES", 100)
    folder = checkpoints[arch]
    engine = small_steps_engine(folder)
    try:
        prompt = random_prompts(4, (40,))[0]
        got = run(prompt_logprobs(engine, prompt))
    finally:
        run(engine.stop())
    # Measured: about 1e-6 from transformers on each (float32 against float64 logprobs of its
    # float32 logits); dropping any one Gemma feature moves some logprob by 0.3 to 4.
    assert distance(got, hf_prompt_logprobs(folder, prompt)) < 1e-4


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_bfloat16_prompt_logprobs_match_transformers_in_bfloat16(checkpoints, arch):
    """What CUDA runs, here on the CPU: where each step rounds to bfloat16 (norms in float32 rounded
    once, the embeddings' factor sqrt(48) = 6.93 rounded to 6.94 first, the capped scores'
    softmax in float32) as transformers rounds it."""
    folder = checkpoints[arch]
    engine = small_steps_engine(folder, dtype="bfloat16")
    try:
        prompt = random_prompts(4, (40,))[0]
        got = run(prompt_logprobs(engine, prompt))
    finally:
        run(engine.stop())
    # Measured: 0 apart on all three; the factor unrounded moves them by about 0.05.
    assert distance(got, hf_prompt_logprobs(folder, prompt, torch.bfloat16)) < 0.01


@pytest.mark.parametrize("arch,config", [
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": 16}),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
])
def test_the_tiny_configs_exercise_what_they_set(checkpoints, arch, config):
    """Each setting the comparisons above rely on changes transformers' own answer (else matching
    it would prove nothing of it): the caps, the query scale, the sliding layer's own rotary
    base, the full layer's rope scaling."""
    folder = checkpoints[arch]
    prompt = random_prompts(4, (40,))[0]
    assert distance(hf_prompt_logprobs(folder, prompt), hf_prompt_logprobs(folder, prompt, **config)) > 0.1


async def with_logprobs(engine, prompt, n):
    """Greedy tokens, their logprobs and each step's two most likely (token, logprob)."""
    req = EngineRequest("t", prompt, SamplingParams(temperature=0.0, logprobs=2), n, ignore_eos=True)
    tokens, logprobs, tops = [], [], []
    async for step in engine.generate(req):
        tokens += step.token_ids
        logprobs += [entry.logprob for entry in step.logprobs]
        tops += [entry.top for entry in step.logprobs]
    return tokens, logprobs, tops


TIE = 1e-4
"""Two tokens whose logprobs are this close are a tie that rounding may break either way."""


def assert_same_greedy_tokens(got, want):
    """``got``'s tokens and logprobs (:func:`with_logprobs`) are ``want``'s (logprobs within 0.02)
    up to the first token where they part, if any; there ``want``'s two best must tie (within
    :data:`TIE`), and what follows is not compared (a tie broken the other way leads elsewhere)."""
    (tokens, logprobs, _), (want_tokens, want_logprobs, want_tops) = got, want
    parted = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), None)
    if parted is not None:
        (_, first), (_, second) = want_tops[parted][:2]
        assert first - second < TIE and tokens[parted] in {token for token, _ in want_tops[parted][:2]}, (
            f"token {parted}: {tokens[parted]} where {want_tokens[parted]} ({want_tops[parted]})")
    end = len(want_tokens) if parted is None else parted
    assert len(tokens) == len(want_tokens) and tokens[:end] == want_tokens[:end]
    assert distance(logprobs[: end + 1], want_logprobs[: end + 1]) < 0.02


@pytest.mark.parametrize("arch,fmt,kv", [
    ("gemma", "int4", "auto"), ("gemma", "int8", "auto"), ("gemma2", "int8", "auto"), ("gemma2", "int4", "bfloat16"),
    ("gemma3", "int4", "auto"), ("gemma3", "int8", "float16"),
])
def test_c_steps_match_the_packed_torch_path(checkpoints, arch, fmt, kv):
    """The one C call per step (GeGLU, the 1 + weight factors, the output norms, the score cap,
    the per-layer rotary tables, with the embedding factor and the logit cap around it) gives the
    packed torch path's tokens, and its logprobs within 0.02: measured up to 0.004 apart (the
    torch path's prompt rows multiply fp16 copies of the weights); the C step without the score
    cap, with the wrong query scale, norm or tables, is 0.15 to 3 apart."""
    assert_c_steps_match_the_torch_path(checkpoints[arch], weight_format=fmt, kv_cache_dtype=kv)


def packed_torch_path_distance(folder, fmt):
    """How far a ``fmt`` (int8, int4) engine of a model the C step cannot run (checked: it has
    no C decoder) puts the prompt logprobs of :func:`engine_prompt_logprobs` from the float32
    engine's."""
    prompt, exact = engine_prompt_logprobs(folder)
    engine = engine_for(folder, block_size=4, max_batched_tokens=16, weight_format=fmt)
    try:
        assert engine._decoder is None
        got = run(prompt_logprobs(engine, prompt))
    finally:
        run(engine.stop())
    return distance(got, exact)


def test_greedy_tokens_may_part_at_a_tie_only():
    want = ([5, 6, 7], [-1.0, -2.0, -3.0], [[(5, -1.0), (9, -1.5)], [(6, -2.0), (8, -2.00005)], [(7, -3.0), (1, -4.0)]])
    assert_same_greedy_tokens(want, want)
    assert_same_greedy_tokens(([5, 8, 2], [-1.0, -2.00005, -0.1], None), want)  # parted at the tie: the rest differs
    for got in (([5, 9, 7], [-1.0, -2.0, -3.0], None),  # parted where the best is 0.5 ahead
                ([9, 6, 7], [-1.5, -2.0, -3.0], None),
                ([5, 6, 7], [-1.0, -2.05, -3.0], None),  # a logprob 0.05 off
                ([5, 8], [-1.0, -2.00005], None)):  # fewer tokens
        with pytest.raises(AssertionError):
            assert_same_greedy_tokens(got, want)


def assert_c_steps_match_the_torch_path(folder, lengths=(5, 23, 40, 11), **options):
    """Prompts of ``lengths`` at once, greedy, through the one C call per step (every step, some
    mixing prompt chunks and decode rows) and through ``CausalLM.forward``: the same tokens,
    logprobs within 0.02, up to a tie (:func:`assert_same_greedy_tokens`). ``options``: the engine's (16-token steps unless they say otherwise)."""
    prompts = random_prompts(2, lengths)
    outputs = {}
    for kernels in (True, False):
        engine = engine_for(folder, **{"block_size": 4, "max_batched_tokens": 16, **options})
        try:
            if kernels:
                calls = counting_decoder(engine)
            else:
                engine.runner.decoder = None  # every step through CausalLM.forward

            async def all_at_once():
                return await asyncio.gather(*(with_logprobs(engine, p, 20) for p in prompts))

            outputs[kernels] = run(all_at_once())
            if kernels:
                assert calls["n"] >= 19 and calls["mixed"] >= 1
        finally:
            run(engine.stop())
    for got, want in zip(outputs[True], outputs[False]):
        assert_same_greedy_tokens(got, want)


def test_an_image_text_checkpoint_gives_its_language_model_and_reads_no_vision_weight(checkpoints, monkeypatch):
    folder = checkpoints["gemma3-mm"]
    read = []
    from safetensors import safe_open

    class Reader:  # records which tensors are read
        def __init__(self, *args, **kwargs):
            self.inner = safe_open(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.file.get_tensor(key)

    monkeypatch.setattr("safetensors.safe_open", Reader)
    weights = _safetensors_weights(folder, _language_model_weight)
    assert read and not [k for k in read if "vision" in k or "multi_modal" in k]
    # The names a text-only Gemma 3 has (its embedding tied: no lm_head).
    text_only = _safetensors_weights(checkpoints["gemma3"])
    assert sorted(weights) == sorted(text_only)
    assert all(weights[k].shape == text_only[k].shape for k in weights)


def test_language_model_names_of_an_image_text_checkpoint():
    assert _language_model_weight("language_model.model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj.weight"
    assert _language_model_weight("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert _language_model_weight("language_model.lm_head.weight") == "lm_head.weight"
    assert _language_model_weight("lm_head.weight") == "lm_head.weight"
    for key in ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "model.vision_tower.head.probe",
                "multi_modal_projector.mm_input_projection_weight", "model.multi_modal_projector.mm_soft_emb_norm.weight"):
        assert _language_model_weight(key) is None


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "starcoder2", "stablelm", "nemotron", "falcon", "gpt2", "bloom"])
def test_gguf_files_the_reader_converts_wrongly_are_refused_before_converting(tmp_path, arch):
    """transformers' GGUF reader drops Gemma 3's rope scaling and the 27Bs' query scale (and
    StarCoder2's rope base and window, StableLM's and Nemotron's rotated share, Falcon 40B's
    grouping): such a file is refused (naming the llamacpp backend, which runs it as it is)
    before any conversion."""
    import gguf

    from backends.torch.loader import gguf_architecture, load_checkpoint
    from torch_models import GGUF

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_architecture(path) == arch and gguf_architecture(GGUF) == "llama"
    with pytest.raises(ValueError, match=f'a {arch} GGUF file, .*backend = "llamacpp"'):
        load_checkpoint(path)
    (tmp_path / "not.gguf").write_bytes(b"not a GGUF file at all")
    assert gguf_architecture(tmp_path / "not.gguf") is None


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_float16_is_refused_for_gemma_2_and_3(checkpoints, arch):
    with pytest.raises(ValueError, match='dtype = "float16": Gemma 2, 3 and 4 overflow float16'):
        small_steps_engine(checkpoints[arch], dtype="float16")


def _gemma_config(model_type, **changes):
    from transformers import AutoConfig

    if model_type == "gemma3":
        return AutoConfig.for_model(model_type, **changes)
    return AutoConfig.for_model(model_type, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=12,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8, **changes)


def test_specs_of_the_three_gemmas():
    one = ModelSpec.from_hf_config(_gemma_config("gemma"))
    assert (one.activation, one.offset_norms, one.sandwich_norms, one.qk_norm) == ("gelu_tanh", True, False, False)
    assert one.embed_scale == 32**0.5 and one.sliding_window is None and one.attention_scale == 8**-0.5
    # Gemma's first configs say "gelu" and mean the tanh form (as transformers reads them).
    assert ModelSpec.from_hf_config(_gemma_config("gemma", hidden_act="gelu")).activation == "gelu_tanh"

    two = ModelSpec.from_hf_config(_gemma_config("gemma2", query_pre_attn_scalar=144))
    assert two.sandwich_norms and not two.qk_norm and two.attention_scale == 144**-0.5
    assert (two.attn_softcap, two.final_softcap) == (50.0, 30.0)  # Gemma 2's defaults
    assert [i for i in range(12) if two.window_of(i)] == [0, 2, 4, 6, 8, 10] and two.sliding_window == 4096
    assert two.local_rope() is None

    three = ModelSpec.from_hf_config(_gemma_config("gemma3_text", rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert three.sandwich_norms and three.qk_norm and (three.attn_softcap, three.final_softcap) == (None, None)
    assert [i for i in range(12) if three.window_of(i) is None] == [5, 11]  # five of every six slide
    assert (three.rope_theta, three.rope_scaling["rope_type"], three.rope_scaling["factor"]) == (1e6, "linear", 8.0)
    local = three.local_rope()
    assert (local.rope_theta, local.rope_scaling["rope_type"]) == (1e4, "default")
    # max_position_embeddings is already the stretched context (vLLM reads Gemma 3 so too).
    assert three.context_length == 131072

    wrapped = ModelSpec.from_hf_config(_gemma_config("gemma3"))  # the image-text model: its text config
    assert wrapped.qk_norm and wrapped.num_layers == 26 and wrapped.local_rope_theta == 1e4


def test_configs_written_by_transformers_4():
    # No layer_types (Gemma 2: every second layer slides; Gemma 3: sliding_window_pattern) and
    # Gemma 3's bases in rope_theta / rope_local_base_freq.
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=8192,
                sliding_window=512, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=8,
                final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True)
    two = ModelSpec.from_hf_config(SimpleNamespace(model_type="gemma2", rope_theta=10000.0, **base))
    assert [i for i in range(8) if two.window_of(i)] == [0, 2, 4, 6]
    three = ModelSpec.from_hf_config(SimpleNamespace(
        model_type="gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=4,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, **base))
    assert [i for i in range(8) if three.window_of(i) is None] == [3, 7]
    assert three.rope_theta == 1e6 and three.rope_scaling["factor"] == 8.0
    assert three.local_rope().rope_theta == 1e4 and three.local_rope().rope_scaling["rope_type"] == "default"


@pytest.mark.parametrize("changes,message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "hidden_act `relu`"),
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping -1.0"),
])
def test_gemma_configs_refused_by_name(changes, message):
    with pytest.raises(ModelError, match=message):
        ModelSpec.from_hf_config(_gemma_config("gemma3_text", **changes))
