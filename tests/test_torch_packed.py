"""The torch engine's packed weight formats (int8, int4): their C decode path, their batching, their
distance from float32."""

from __future__ import annotations

import asyncio

import pytest

from backends.torch import TorchConfig, native
from backends.torch.cpu_decode import PROMPT_POSITIONS, VNNI_PROMPT_POSITIONS, prompt_positions
from backends.torch.scheduler import Scheduled
from backends.torch.sequence import Sequence
from backends.torch.setup import build_engine
from router.engine import EngineRequest, SamplingParams
from test_torch_engine import LENGTHS, PROMPTS, engine_for, generate, generate_all, random_prompts, run
from torch_models import smollm2_folder, tiny_checkpoint


def counting_decoder(engine):
    """Count the steps the C path runs (it must be the one under test): all of them in ``n``,
    those that mix decode rows and prompt chunks in ``mixed``."""
    decoder = engine.runner.decoder
    calls = {"n": 0, "mixed": 0}
    logits = decoder.logits

    def counted(step, *rows):
        calls["n"] += 1
        decodes = sum(w.is_decode for w in step.work)
        calls["mixed"] += 0 < decodes < len(step.work)
        return logits(step, *rows)

    decoder.logits = counted
    return calls


ARCH_FORMATS = [(arch, fmt, "auto") for fmt in ("int8", "int4") for arch in ("llama", "qwen2", "mistral", "llama-odd")]
ARCH_FORMATS += [("qwen2-window", "int4", "auto"), ("qwen3", "int8", "auto"), ("qwen3", "int4", "float16"),
                 ("phi3", "int4", "auto"), ("phi3-longrope", "int8", "auto"), ("llama-dynamic", "int4", "auto")]


@pytest.mark.parametrize(
    "arch,fmt,kv",
    ARCH_FORMATS + [("llama", "int4", "float16"), ("mistral", "int4", "float16"), ("llama-odd", "int8", "float16"),
                    ("qwen2", "int4", "bfloat16")],
)
def test_c_decode_steps_match_the_packed_torch_path(tmp_path, arch, fmt, kv):
    # llama: llama3 rope scaling; qwen2: qkv bias, tied embeddings; mistral: sliding window of 8;
    # llama-odd: hidden 80, intermediate 200 (neither a multiple of the 32-input group), 5 heads
    # on 1 KV head, biases on every projection but the LM head; qwen2-window: a window on one
    # layer of two; qwen3: query and key norms (in C, head_norms); phi3-longrope: 4 of 16
    # dimensions of each head unrotated (cos 1, sin 0 in the tables the C kernel reads) and the
    # long factors past 32 positions; llama-dynamic: the base raised past 32. A 16-bit KV cache: both paths
    # round keys and values the same way when they write them.
    folder = tiny_checkpoint(tmp_path / arch, arch)
    prompts = random_prompts(2, (5, 23, 40, 11))
    outputs = {}
    for kernels in (True, False):
        engine = engine_for(folder, weight_format=fmt, block_size=4, max_batched_tokens=16, kv_cache_dtype=kv)
        try:
            if kernels:
                calls = counting_decoder(engine)
            else:
                engine.runner.decoder = None  # every step through CausalLM.forward
            outputs[kernels] = generate_all(engine, prompts, 20)
            if kernels:
                assert calls["n"] >= 19  # the decode steps ran in C
        finally:
            run(engine.stop())
    assert outputs[True] == outputs[False]


@pytest.fixture(scope="module", params=["int8", "int4"])
def smol_packed(request):
    engine = engine_for(smollm2_folder(), weight_format=request.param)
    engine.fmt = request.param
    yield engine
    run(engine.stop())


def test_packed_batched_equals_alone_and_stays_close_to_float32(smol_packed):
    folder = smollm2_folder()
    ids = [smol_packed.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    calls = counting_decoder(smol_packed)
    alone = [run(generate(smol_packed, i, 32))[0] for i in ids]
    assert calls["n"] >= 8 * 31

    # 12 sequences (the 8 prompts, then 4 again with other lengths): decode steps of up to 12
    # rows, all in C.
    lengths = LENGTHS + [32, 7, 19, 28]
    prompts = ids + ids[:4]

    async def all_at_once():
        return await asyncio.gather(*(generate(smol_packed, i, n) for i, n in zip(prompts, lengths)))

    calls["n"] = 0
    batched = [out for out, _ in run(all_at_once())]
    assert calls["n"] >= max(lengths) - 1
    # Rows are quantized one by one and the kernel's loops give a row the same bits whatever the
    # batch, so in a decode step a sequence's tokens do not depend on its neighbours, however many.
    assert [b == a[: len(b)] for a, b in zip(alone + alone[:4], batched)] == [True] * 12

    # Staggered: each request starts once the one before it has 3 tokens, so its prompt is
    # computed in a step with the others' decode rows, also in C, and nothing changes either.
    async def staggered():
        outs = [[] for _ in ids]
        started = [asyncio.Event() for _ in ids]

        async def one(i):
            if i:
                await started[i - 1].wait()
            req = EngineRequest("t", ids[i], SamplingParams(temperature=0.0), 32, ignore_eos=True)
            async for out in smol_packed.generate(req):
                outs[i] += out.token_ids
                if len(outs[i]) >= 3:
                    started[i].set()

        await asyncio.gather(*(one(i) for i in range(len(ids))))
        return outs

    calls["n"] = calls["mixed"] = 0
    assert run(staggered()) == alone
    assert calls["mixed"] >= len(ids) - 1

    native = engine_for(folder)
    try:
        reference = [run(generate(native, i, 32))[0] for i in ids]
    finally:
        run(native.stop())
    # Both formats reproduce this file's weights exactly (Q4_1 projections, a Q8_0 LM head), so
    # only the int16 activations and float rounding differ from float32. Greedy decoding amplifies
    # any difference once two candidates are near a tie; measured: all 8 prompts agree on all 32
    # tokens in both formats (fp16 weights: 7 of 8, one parting at 27; int8 before its LM head
    # was exact: 6 of 8, parting at 27 and 30).
    agree = [next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), 32) for ours, ref in zip(alone, reference)]
    assert min(agree) >= 24, agree
    assert sum(a == 32 for a in agree) >= 7, agree


def test_long_prompt_chunks_run_as_torch_operations(smol_packed, monkeypatch):
    """The C attention takes a token and head at a time: a step whose prompt chunks attend to more
    than the decoder's limit of positions runs as torch operations, the decode steps after it in C."""
    assert smol_packed.runner.decoder.prompt_positions == (
        VNNI_PROMPT_POSITIONS if native.kernels().simd == 2 else PROMPT_POSITIONS
    )
    monkeypatch.setattr(smol_packed.runner.decoder, "prompt_positions", PROMPT_POSITIONS)
    calls = counting_decoder(smol_packed)
    short, long = random_prompts(3, (100, 400))
    assert prompt_positions_of(short) <= PROMPT_POSITIONS < prompt_positions_of(long)
    run(generate(smol_packed, short, 4))
    assert calls["n"] == 4  # the prompt's step and three decode steps
    calls["n"] = 0
    run(generate(smol_packed, long, 4))
    assert calls["n"] == 3


def prompt_positions_of(prompt):
    seq = Sequence(EngineRequest("t", prompt, SamplingParams(), 1), lambda _: None, 16)
    return prompt_positions([Scheduled(seq, len(prompt))])


@pytest.mark.parametrize(
    "computed,new,want",
    [(0, 1, 1), (0, 4, 10), (5, 3, 6 + 7 + 8), (0, 128, 8256), (0, 256, 32896), (0, 400, 80200)],
)
def test_prompt_positions_counts_what_each_token_attends_to(computed, new, want):
    seq = Sequence(EngineRequest("t", list(range(computed + new + 1)), SamplingParams(), 1), lambda _: None, 16)
    seq.num_computed = computed
    assert prompt_positions([Scheduled(seq, new)]) == want
    # A decoding sequence's row adds nothing: decode rows always run in C.
    seq2 = Sequence(EngineRequest("t", [1, 2, 3], SamplingParams(), 1), lambda _: None, 16)
    seq2.num_computed = 2
    assert prompt_positions([Scheduled(seq2, 1), Scheduled(seq, new)]) == want


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_packed_formats_are_cpu_float32_formats(tmp_path, fmt):
    folder = tiny_checkpoint(tmp_path / "llama", "llama")
    cfg = TorchConfig(name="t", backend="torch", path=str(folder), weight_format=fmt, dtype="bfloat16")
    with pytest.raises(ValueError, match=f'weight_format = "{fmt}" is for the CPU with dtype float32'):
        build_engine(cfg, folder)


@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4"])
def test_a_packed_model_is_packed_layer_by_layer_as_it_loads(tmp_path, fmt):
    """Each decoder layer is packed as soon as its weights are in, and its float weights are
    freed then (nothing keeps the replaced modules): loading never holds the whole float model
    beside the packed one. The result is the model packed after loading."""
    import gc
    import weakref

    import torch
    from torch import nn

    from backends.torch.loader import load_checkpoint
    from backends.torch.model import CausalLM
    from backends.torch.quantize import PACKINGS

    folder = tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    checkpoint = load_checkpoint(folder)
    spec, packed_before = checkpoint.spec, []

    def pack(module):
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        if isinstance(module, CausalLM):  # the last call: only the LM head is left
            assert linears == [module.lm_head]
        else:
            assert len(linears) == 4  # this layer's qkv, o, gate_up, down
            floats.append([weakref.ref(m) for m in linears])
            gc.collect()
            # Every earlier layer's float modules are gone once it was packed.
            packed_before.append(all(r() is None for refs in floats[:-1] for r in refs))
        PACKINGS[fmt](module)

    floats: list[list[weakref.ref]] = []
    model = CausalLM.from_state_dict(spec, 64, dict(checkpoint.weights), pack=pack)
    assert len(floats) == spec.num_layers and all(packed_before)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())

    reference = CausalLM.from_state_dict(spec, 64, dict(load_checkpoint(folder).weights))
    PACKINGS[fmt](reference)
    for ours, theirs in zip(model.modules(), reference.modules()):
        assert type(ours) is type(theirs)
        if hasattr(ours, "_packed"):
            a, b = ours._packed, theirs._packed
            if not isinstance(a, torch.Tensor):  # fbgemm's fp16 packing: its weight and bias back
                a, b = torch.ops.quantized.linear_unpack_fp16(a)[0], torch.ops.quantized.linear_unpack_fp16(b)[0]
            assert torch.equal(a, b)
