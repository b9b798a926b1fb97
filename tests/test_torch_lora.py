"""LoRA adapters on the torch engine: output against transformers with the adapter merged into
the weights, mixed batches, the prefix cache kept apart per adapter, packed formats, and the
adapters this engine refuses (with a message naming what is wrong)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from backends.torch import TorchConfig
from backends.torch.lora import AdapterError, load_adapter
from backends.torch.model import ModelSpec
from backends.torch.sequence import Status
from backends.torch.setup import build_engine
from router.engine import EngineError, EngineRequest, SamplingParams
from test_torch_engine import generate, random_prompts, run
from torch_models import LORA_TARGETS, hf_greedy, merged_checkpoint, tiny_checkpoint, write_lora

FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # how PEFT names Phi-3's modules
GLM = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")  # GLM-4's: gate and up fused only


def engine_with(base, adapters, **options):
    options = {"max_model_len": 512, "kv_cache_gb": 0.05, "block_size": 4, "max_batched_tokens": 16, **options}
    cfg = TorchConfig(name="t", backend="torch", path=str(base), **options)
    return build_engine(cfg, base, adapters)


def all_at_once(engine, jobs, n):
    """``jobs``: (prompt, adapter) pairs, run as one continuous batch; their outputs."""
    async def gather():
        return await asyncio.gather(*(generate(engine, p, n, a) for p, a in jobs))

    return [out for out, _ in run(gather())]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama, two adapters (every projection at r 4; q and v only at r 8 with rsLoRA) and
    the checkpoints with each merged in."""
    root = tmp_path_factory.mktemp("lora")
    base = tiny_checkpoint(root / "base", "llama")
    every = write_lora(root / "every", base, seed=1)
    qv = write_lora(root / "qv", base, rank=8, alpha=4.0, targets=("q_proj", "v_proj"), seed=2, use_rslora=True)
    merged = {"every": merged_checkpoint(base, every, root / "every-merged"),
              "qv": merged_checkpoint(base, qv, root / "qv-merged")}
    return base, {"every": every, "qv": qv}, merged


def test_a_mixed_batch_of_base_and_two_adapters_matches_transformers_with_merged_weights(llama):
    base, adapters, merged = llama
    engine = engine_with(base, adapters)
    try:
        prompts = random_prompts(3, [9, 17, 5, 23])
        jobs = [(p, a) for p in prompts for a in (None, "every", "qv")]
        outs = all_at_once(engine, jobs, 12)
    finally:
        run(engine.stop())
    for (prompt, adapter), out in zip(jobs, outs):
        ref = hf_greedy(base if adapter is None else merged[adapter], prompt, 12)
        assert out == ref, (adapter, len(prompt))
    # The adapters do change the output (else the comparison above proves nothing).
    for i in range(len(prompts)):
        base_out, every_out, qv_out = outs[3 * i : 3 * i + 3]
        assert base_out != every_out and base_out != qv_out


@pytest.mark.parametrize("arch,targets", [("phi3", FUSED), ("phi3-longrope", FUSED), ("glm4", GLM)])
def test_adapters_of_fused_projections_and_reordered_heads(tmp_path, arch, targets):
    # phi3-longrope: a partial rotary, for which the loader reorders each query and key head
    # (ModelSpec.qk_layout): the adapters' q and k rows move with the base model's; glm4: its
    # interleaved rotary pairs reordered so too, and its gate and up fused.
    base = tiny_checkpoint(tmp_path / arch, arch)
    adapter = write_lora(tmp_path / "ad", base, targets=targets)
    merged = merged_checkpoint(base, adapter, tmp_path / "merged")
    engine = engine_with(base, {"ad": adapter})
    try:
        prompts = random_prompts(4, [14, 6])
        outs = all_at_once(engine, [(p, "ad") for p in prompts], 10)
    finally:
        run(engine.stop())
    assert outs == [hf_greedy(merged, p, 10) for p in prompts]


def test_the_prefix_cache_is_kept_apart_per_adapter(llama):
    base, adapters, merged = llama
    engine = engine_with(base, adapters)
    prompt = random_prompts(5, [30])[0]
    try:
        plain, plain_cached = run(generate(engine, prompt, 6))
        first, first_cached = run(generate(engine, prompt, 6, "every"))
        again, again_cached = run(generate(engine, prompt, 6, "every"))
        other, other_cached = run(generate(engine, prompt, 6, "qv"))
        assert engine.pool.num_used == 0
    finally:
        run(engine.stop())
    # The same tokens under another adapter are other keys and values: no hit across adapters.
    assert plain_cached == 0 and first_cached == 0 and other_cached == 0
    assert again_cached == 28  # 7 full blocks of 4, the last token left to compute
    assert first == again == hf_greedy(merged["every"], prompt, 6)
    assert other == hf_greedy(merged["qv"], prompt, 6)
    assert plain == hf_greedy(base, prompt, 6)


def test_preemption_under_a_tiny_budget_keeps_adapter_outputs(llama):
    base, adapters, merged = llama
    # 16 blocks of 4 tokens (2 KiB each: 2 layers, keys and values, 2 heads of 16 floats) for
    # four sequences growing to 7-11 blocks each.
    engine = engine_with(base, adapters, kv_cache_gb=16 * 2048 / 2**30)
    assert engine.pool.num_blocks == 16
    try:
        prompts = random_prompts(6, [20, 25, 18, 22])
        jobs = [(p, a) for p, a in zip(prompts, ("every", "qv", None, "every"))]
        outs = all_at_once(engine, jobs, 16)
        preempted = engine.scheduler.preemptions
        assert engine.pool.num_used == 0
    finally:
        run(engine.stop())
    assert preempted > 0
    for (prompt, adapter), out in zip(jobs, outs):
        assert out == hf_greedy(base if adapter is None else merged[adapter], prompt, 16)


@pytest.mark.parametrize("arch,fmt", [("llama", "int8"), ("llama", "int4"), ("llama-odd", "int8"), ("phi3", "int4"),
                                      ("gemma3", "int4")])
def test_c_steps_with_adapter_rows_match_the_packed_torch_path(tmp_path, arch, fmt):
    """The int8/int4 formats' one C call adds each adapter row's products itself (lora_add): the
    same tokens as the packed torch path (LoraLinear), in steps mixing base rows, two adapters
    (one leaving k alone between q and v), decodes and prompt chunks. llama-odd: sizes off
    every tile and group, biases everywhere; phi3: an adapter of the fused matrices; gemma3: o's
    and down's products land before the norms of the blocks' outputs."""
    base = tiny_checkpoint(tmp_path / arch, arch)
    fused = arch == "phi3"
    adapters = {"every": write_lora(tmp_path / "every", base, targets=FUSED if fused else LORA_TARGETS),
                "qv": write_lora(tmp_path / "qv", base, rank=8, targets=("qkv_proj",) if fused else ("q_proj", "v_proj"),
                                 seed=2)}
    # The prompts of test_torch_packed's comparison (other ones meet a near-tie that the two
    # paths' roundings break differently, adapters or none, on llama-odd).
    prompts = random_prompts(2, (5, 23, 40, 11))
    jobs = [(p, a) for p, a in zip(prompts, [None, "every", "qv", "every"])]
    outputs = {}
    for kernels in (True, False):
        engine = engine_with(base, adapters, weight_format=fmt)
        try:
            if kernels:
                assert engine.runner.decoder.serves_adapters
                calls = adapter_steps_in_c(engine)
            else:
                engine.runner.decoder = None  # every step through CausalLM.forward and LoraLinear
            outputs[kernels] = all_at_once(engine, jobs, 16)
            if kernels:
                assert calls["adapted"] >= 15
        finally:
            run(engine.stop())
    assert outputs[True] == outputs[False]
    assert outputs[True][1] != all_at_once_base(base, fmt, prompts[1])


def adapter_steps_in_c(engine):
    decoder, calls = engine.runner.decoder, {"adapted": 0}
    logits = decoder.logits

    def counted(step, rows=None, row_adapters=None):
        calls["adapted"] += row_adapters is not None and any(row_adapters)
        return logits(step, rows, row_adapters)

    decoder.logits = counted
    return calls


def test_adapters_beyond_the_c_limits_run_the_packed_torch_path(tmp_path):
    """Four parts to one projection (q, k, v and the fused qkv as well) is more than C's table
    holds: nothing is attached, and those steps take the torch path, with its output."""
    from safetensors.torch import load_file, save_file

    base = tiny_checkpoint(tmp_path / "llama", "llama")
    folder = write_lora(tmp_path / "ad", base, targets=("q_proj", "k_proj", "v_proj"))
    weights = load_file(str(folder / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    for layer in range(2):
        key = f"base_model.model.model.layers.{layer}.self_attn.qkv_proj"
        weights[f"{key}.lora_A.weight"] = torch.randn(4, 64, generator=gen) * 0.2
        weights[f"{key}.lora_B.weight"] = torch.randn(64 + 2 * 32, 4, generator=gen) * 0.2
    save_file(weights, str(folder / "adapter_model.safetensors"))
    prompts = random_prompts(2, (5, 23))
    outputs = {}
    for kernels in (True, False):
        engine = engine_with(base, {"ad": folder}, weight_format="int8")
        try:
            assert not engine.runner.decoder.serves_adapters
            if not kernels:
                engine.runner.decoder = None
            outputs[kernels] = all_at_once(engine, [(p, a) for p in prompts for a in (None, "ad")], 12)
        finally:
            run(engine.stop())
    assert outputs[True] == outputs[False] and outputs[True][0] != outputs[True][1]


def all_at_once_base(base, fmt, prompt):
    engine = engine_with(base, {}, weight_format=fmt)
    try:
        return all_at_once(engine, [(prompt, None)], 16)[0]
    finally:
        run(engine.stop())


def test_the_fp16_format_serves_adapters_on_the_torch_path(llama, tmp_path):
    """fp16 weights (fbgemm, no C decoder): an adapter whose B is zero gives the base model's
    tokens exactly, in mixed and adapter-only steps; a real one its own."""
    base, adapters, _ = llama
    zero = write_lora(tmp_path / "zero", base, zero_b=True)
    engine = engine_with(base, {"zero": zero, "every": adapters["every"]}, weight_format="fp16")
    try:
        assert engine.runner.decoder is None
        prompts = random_prompts(7, [11, 19, 7])
        plain = all_at_once(engine, [(p, None) for p in prompts], 12)
        mixed = all_at_once(engine, [(p, a) for p in prompts for a in (None, "zero", "every")], 12)
        alone = all_at_once(engine, [(p, "zero") for p in prompts], 12)
    finally:
        run(engine.stop())
    assert mixed[0::3] == plain and mixed[1::3] == plain and alone == plain
    assert all(e != p for e, p in zip(mixed[2::3], plain))


def test_an_unknown_adapter_is_an_engine_error(llama):
    base, adapters, _ = llama
    engine = engine_with(base, {"every": adapters["every"]})
    try:
        with pytest.raises(EngineError, match="no LoRA adapter `qv`"):
            run(generate(engine, [5, 6, 7], 2, "qv"))
    finally:
        run(engine.stop())


# --- what is refused, and how it is said ---------------------------------------------------


@pytest.fixture(scope="module")
def spec(llama):
    from transformers import AutoConfig

    return ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(llama[0]), local_files_only=True))


def _load(folder, spec):
    return load_adapter("ad", folder, spec, torch.float32, torch.device("cpu"))


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_load_reads_ranks_scales_and_slices(llama, spec, tmp_path):
    base = llama[0]
    adapter = _load(write_lora(tmp_path / "a", base, rank=4, alpha=8.0, targets=("k_proj", "up_proj")), spec)
    assert adapter.rank == 4 and adapter.scale == 2.0
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    assert sorted(adapter.parts) == [(i, m) for i in range(spec.num_layers) for m in ("gate_up_proj", "qkv_proj")]
    (start, end, a, b), = adapter.parts[(0, "qkv_proj")]
    assert (start, end, a.shape, b.shape) == (q, q + kv, (4, spec.hidden_size), (kv, 4))
    assert adapter.parts[(1, "gate_up_proj")][0][:2] == (inter, 2 * inter)
    rs = _load(write_lora(tmp_path / "rs", base, rank=16, alpha=8.0, targets=("o_proj",), use_rslora=True), spec)
    assert rs.scale == 2.0  # alpha / sqrt(r)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
        ({"lora_bias": True}, "lora_bias"),
        ({"trainable_token_indices": [5, 6]}, "trainable_token_indices"),
        ({"bias": "all"}, 'bias `all` is not supported; only "none"'),
        ({"peft_type": "IA3"}, "peft_type `IA3` is not supported"),
        ({"r": 0}, "integer `r` >= 1"),
        ({"r": 8}, r"lora_A \(4, 64\) and lora_B \(64, 4\), expected \(8, 64\) and \(64, 8\)"),
    ],
)
def test_unsupported_adapter_configs_are_refused_by_name(llama, spec, tmp_path, changes, message):
    folder = write_lora(tmp_path / "a", llama[0], targets=("q_proj",))
    _edit_config(folder, **changes)
    with pytest.raises(AdapterError, match=message) as info:
        _load(folder, spec)
    assert str(info.value).startswith(f"LoRA adapter `ad` ({folder}): ")


def test_adapters_of_other_modules_or_shapes_are_refused(llama, spec, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_lora(tmp_path / "a", llama[0], targets=("q_proj",))
    weights = load_file(str(folder / "adapter_model.safetensors"))
    cases = [
        ({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, "only the layers' projections"),
        ({"base_model.model.model.layers.0.mlp.fc1.lora_A.weight": torch.zeros(4, 64)}, "module `fc1` is not supported"),
        ({"base_model.model.model.layers.7.self_attn.o_proj.lora_A.weight": torch.zeros(4, 64)}, "has 2 layers"),
        ({"base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight": torch.zeros(4, 64)}, "lora_A without its pair"),
    ]
    for extra, message in cases:
        save_file({**weights, **extra}, str(folder / "adapter_model.safetensors"))
        with pytest.raises(AdapterError, match=message):
            _load(folder, spec)
    save_file({}, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="holds no LoRA weights"):
        _load(folder, spec)
    (folder / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="adapter_model.safetensors cannot be read"):
        _load(folder, spec)
    config = (folder / "adapter_config.json").read_text()
    (folder / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(AdapterError, match="not a JSON object"):
        _load(folder, spec)
    (folder / "adapter_config.json").write_text(config)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        _load(folder, spec)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        _load(tmp_path / "nowhere", spec)


def test_select_groups_each_adapters_rows_as_a_slice_when_consecutive():
    from types import SimpleNamespace

    from backends.torch.lora import Adapters

    adapters = Adapters.__new__(Adapters)  # no model to wrap: select only reads the work
    adapters.batch, adapters.device = SimpleNamespace(groups=[]), torch.device("cpu")

    def work(*pairs):  # (adapter index, rows) per sequence, in step order
        return [SimpleNamespace(seq=SimpleNamespace(adapter=a), num_new=n) for a, n in pairs]

    assert not adapters.select(work((0, 1), (0, 5)))
    assert adapters.batch.groups == []
    assert adapters.select(work((2, 1), (2, 1), (0, 1), (1, 3)))
    (two, rows_two), (one, rows_one) = adapters.batch.groups
    assert (two, rows_two, one, rows_one) == (2, slice(0, 2), 1, slice(3, 6))
    assert adapters.select(work((1, 1), (0, 1), (1, 2)))
    ((one, rows),) = adapters.batch.groups
    assert one == 1 and rows.tolist() == [0, 2, 3]
    assert Adapters.row_adapters(work((1, 1), (0, 1), (1, 2))) == [1, 0, 1, 1]


# --- adapters loaded and unloaded while the engine serves --------------------------------


def test_adapters_load_and_unload_at_run_time(llama, tmp_path):
    """Loaded while serving: the same output as transformers with it merged. Unloaded: gone.
    Loaded again under the same name with other weights: the new weights, and none of the
    blocks the old one left in the prefix cache."""
    base, adapters, merged = llama
    engine = engine_with(base, {})
    prompt = random_prompts(11, [26])[0]
    try:
        assert "lora_adapters" in engine.capabilities
        plain, _ = run(generate(engine, prompt, 8))
        run(engine.add_adapter("a", adapters["every"]))
        first, first_cached = run(generate(engine, prompt, 8, "a"))
        again, again_cached = run(generate(engine, prompt, 8, "a"))
        with pytest.raises(AdapterError, match="`a` is already loaded"):
            run(engine.add_adapter("a", adapters["qv"]))
        run(engine.remove_adapter("a"))
        with pytest.raises(EngineError, match="no LoRA adapter `a`"):
            run(generate(engine, prompt, 2, "a"))
        with pytest.raises(AdapterError, match="`a` is not loaded"):
            run(engine.remove_adapter("a"))
        run(engine.add_adapter("a", adapters["qv"]))
        reloaded, reloaded_cached = run(generate(engine, prompt, 8, "a"))
        with pytest.raises(AdapterError, match="no adapter_config.json"):
            run(engine.add_adapter("b", tmp_path / "nowhere"))
        after, _ = run(generate(engine, prompt, 8))
        assert engine.pool.num_used == 0
    finally:
        run(engine.stop())
    assert plain == after == hf_greedy(base, prompt, 8)
    assert first == again == hf_greedy(merged["every"], prompt, 8)
    assert (first_cached, again_cached) == (0, 24)
    assert reloaded == hf_greedy(merged["qv"], prompt, 8) and reloaded_cached == 0


def test_an_adapter_in_use_is_not_unloaded(llama):
    base, adapters, _ = llama
    engine = engine_with(base, {"every": adapters["every"]})

    async def scenario():
        req = EngineRequest("t", [5, 6, 7], SamplingParams(temperature=0.0), 400, ignore_eos=True, adapter="every")
        stream = engine.generate(req)
        await stream.__anext__()  # running, 399 tokens to go
        with pytest.raises(AdapterError, match="`every` is serving 1 request"):
            await engine.remove_adapter("every")
        await stream.aclose()  # the client leaves: the sequence is aborted
        await engine.remove_adapter("every")
        # Another request: by its end the engine has surely freed the aborted one's blocks.
        async for _ in engine.generate(EngineRequest("u", [5, 6], SamplingParams(temperature=0.0), 2)):
            pass

    try:
        run(scenario())
        assert engine.adapters.index == {} and engine.pool.num_used == 0
    finally:
        run(engine.stop())


def test_an_aborted_sequence_of_an_unloaded_adapter_never_runs_again(llama):
    """The client's abort is a flag first and a message to the engine after: an unload that
    runs between the two finishes the sequence itself, so no step (here the C call, whose
    table no longer has that adapter) runs it with an index that is gone."""
    base, adapters, _ = llama
    engine = engine_with(base, {"every": adapters["every"]}, weight_format="int8")

    async def scenario():
        req = EngineRequest("t", [5, 6, 7], SamplingParams(temperature=0.0), 400, ignore_eos=True, adapter="every")
        stream = engine.generate(req)
        await stream.__anext__()
        (seq,) = engine.scheduler.running
        seq.aborted = True  # as generate()'s finally does, before it hands the abort in
        await engine.remove_adapter("every")
        assert seq.status is Status.FINISHED and engine.runner.decoder._plan.num_adapters == 0
        await stream.aclose()
        out, _ = await generate(engine, [5, 6, 7], 4)
        return out

    try:
        assert run(scenario()) == all_at_once(engine, [([5, 6, 7], None)], 4)[0]
        assert engine.pool.num_used == 0
    finally:
        run(engine.stop())


def test_the_c_step_serves_adapters_loaded_at_run_time(llama):
    """int8: an adapter loaded while serving enters the C table (rebuilt between steps), with
    the output of the same adapter configured at start; an unloaded one leaves a free index
    the next load reuses."""
    base, adapters, _ = llama
    prompts = random_prompts(12, (9, 21))
    static = engine_with(base, {"qv": adapters["qv"]}, weight_format="int8")
    try:
        want = all_at_once(static, [(p, "qv") for p in prompts], 12)
    finally:
        run(static.stop())
    engine = engine_with(base, {}, weight_format="int8")
    try:
        run(engine.add_adapter("every", adapters["every"]))
        run(engine.add_adapter("qv", adapters["qv"]))
        run(engine.remove_adapter("every"))
        assert engine.adapters.index == {"qv": 2} and engine.runner.decoder.serves_adapters
        calls = adapter_steps_in_c(engine)
        got = all_at_once(engine, [(p, "qv") for p in prompts], 12)
        assert calls["adapted"] >= 11
        run(engine.add_adapter("every", adapters["every"]))
        assert engine.adapters.index == {"qv": 2, "every": 1}
        assert all_at_once(engine, [(p, "qv") for p in prompts], 12) == want
    finally:
        run(engine.stop())
    assert got == want
