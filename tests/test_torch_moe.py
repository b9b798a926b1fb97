"""Mixtures of experts on the torch engine (Mixtral, Qwen2-MoE, Qwen3-MoE): greedy output against
transformers, float32 and int4, the one C call per step against the torch path, the layers each
config makes sparse, both ways a checkpoint names its experts, preemption, and LoRA adapters
(attention only)."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from torch import nn

from backends.torch.lora import AdapterError, load_adapter
from backends.torch.model import MLP, CausalLM, ModelError, ModelSpec
from backends.torch.moe import SparseMoE
from backends.torch.weights import WeightReader
from backends.torch.quantize import PackedLinear, large_batch_copy, pack_weight, unpack_weight
from test_torch_gemma import assert_c_steps_match_the_torch_path
from test_torch_engine import (
    assert_greedy_matches_transformers, generate, generate_all, random_prompts, run, small_steps_engine,
)
from torch_models import _hf_model, hf_greedy, merged_checkpoint, tiny_checkpoint, write_lora

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: tiny_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_alone_and_in_a_mixed_batch(checkpoints, arch):
    # mixtral: every layer sparse, weights renormalised, a window of 8; qwen2_moe: layer 0 dense,
    # the other sparse with a gated shared expert, weights not renormalised, qkv bias;
    # qwen3_moe: a sparse layer every second one, query and key norms. Four prompts at once in
    # steps of 16 tokens: prompt chunks and decode rows share steps, so an expert's rows mix
    # sequences.
    assert_greedy_matches_transformers(checkpoints[arch])


def _rounded(w: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_weight(pack_weight(w, bits), bits, *w.shape)


def _int4_reference(folder, out):
    """The checkpoint with every weight the int4 format rounds rounded as it does (projections
    and experts at 4 bits, the LM head at 8; embeddings, norms, biases and routers as they are)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("lm_head"):
                p.copy_(_rounded(p, 8))
            elif p.dim() == 3:  # transformers 5 holds an expert's matrices as [experts, out, in]
                for e in range(p.shape[0]):
                    p[e].copy_(_rounded(p[e], 4))
            elif p.dim() == 2 and "embed" not in name and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.copy_(_rounded(p, 4))
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (folder / f).exists():
            shutil.copy(folder / f, out / f)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_int4_experts_give_transformers_output_on_the_rounded_weights(checkpoints, arch, tmp_path):
    folder = checkpoints[arch]
    engine = small_steps_engine(folder, weight_format="int4")
    try:
        moe = next(layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, SparseMoE))
        assert all(isinstance(e.gate_up_proj, PackedLinear) and e.gate_up_proj.bits == 4 for e in moe.experts)
        # Routed experts keep no fp16 copy (it would be 4x their int4 bytes): every row in C.
        assert all(e.down_proj._fp16 is None for e in moe.experts)
        if moe.shared_expert is not None:  # dense: a copy where fbgemm beats the C kernel
            assert (moe.shared_expert.down_proj._fp16 is not None) == large_batch_copy()
        # The router stays float32 (a rounding there moves tokens to other experts); the steps
        # run in one C call (cpu_decode.py), which computes the experts too.
        assert type(moe.gate) is nn.Linear and moe.gate.weight.dtype == torch.float32
        assert engine.runner.decoder is not None
        prompts = random_prompts(1, (5, 23, 40, 11))
        outs = generate_all(engine, prompts, 20)
    finally:
        run(engine.stop())
    reference = _int4_reference(folder, tmp_path / "rounded")
    for ours, p in zip(outs, prompts):
        assert ours == hf_greedy(reference, p, 20)
    # The rounding does matter: the float32 model answers otherwise.
    assert any(ours != hf_greedy(folder, p, 20) for ours, p in zip(outs, prompts))


@pytest.mark.parametrize("arch,fmt", [("mixtral", "int4"), ("qwen2_moe", "int4"), ("qwen3_moe", "int8")])
def test_c_steps_match_the_packed_torch_path(checkpoints, arch, fmt):
    """The one C call per step computes the experts as moe.py does (the float32 router over the
    normalised rows, softmax, the top k, renormalised or not, each expert over its own rows, the
    slots summed, Qwen2-MoE's gated shared expert, its dense layer 0): the packed torch path's
    tokens, logprobs within 0.02 (measured: at most 4e-5 apart), in steps that mix prompt chunks
    and decode rows. Without the renormalisation, or with the shared expert ungated, the C step
    misses transformers' output (test above)."""
    assert_c_steps_match_the_torch_path(checkpoints[arch], weight_format=fmt)


def test_c_steps_of_long_prompts_match_the_packed_torch_path(checkpoints):
    """A 200-token prompt in one step with two short ones (the last finished beside decode
    rows): the router's rows split between threads (rows x experts x hidden above 65,536) and
    each expert's rows in the wide matmul loop (16 or more; about 50 each here), as a real
    model's prompts have them."""
    assert_c_steps_match_the_torch_path(checkpoints["qwen3_moe"], lengths=(200, 9, 60), weight_format="int4",
                                        max_batched_tokens=256)


def _config(arch, **changes):
    from transformers import AutoConfig

    config = AutoConfig.for_model(arch, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("arch,changes,sparse,normalize,shared", [
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}, [0, 1, 2, 3, 4, 5], True, 0),
    ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}, [0, 1, 2, 3, 4, 5], False, 0),
    ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "decoder_sparse_step": 3,
                   "norm_topk_prob": True}, [2, 5], True, 0),
    ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 4, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 48, "mlp_only_layers": [0, 4]}, [1, 2, 3, 5], False, 48),
    ("qwen2_moe", {"num_experts": 0, "num_experts_per_tok": 1, "moe_intermediate_size": 16}, [], False, 48),
])
def test_which_layers_are_mixtures_of_experts(arch, changes, sparse, normalize, shared):
    spec = ModelSpec.from_hf_config(_config(arch, **changes))
    assert [i for i in range(6) if spec.is_sparse(i)] == sparse
    assert spec.is_moe == bool(sparse) and spec.normalize_routing == normalize
    if sparse:
        assert spec.shared_expert_size == shared
        assert spec.expert_size == (64 if arch == "mixtral" else 16)
    model = CausalLM(spec, 32)
    assert [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoE)] == sparse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,changes", [
    ("qwen3_moe", {"num_experts": 16, "num_experts_per_tok": 8, "norm_topk_prob": True}),  # Qwen3-30B-A3B's top-8
    ("qwen2_moe", {"num_experts": 8, "num_experts_per_tok": 4, "shared_expert_intermediate_size": 96}),
    ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),  # routing weights kept in float32
    # The top 4 logits softmaxed among themselves (transformers in float32, then rounded).
    ("granitemoe", {"num_local_experts": 8, "num_experts_per_tok": 4}),
    ("olmoe", {"num_experts": 16, "num_experts_per_tok": 8, "norm_topk_prob": False}),  # OLMoE-1B-7B's top-8
])
def test_a_sparse_block_gives_transformers_bits(arch, changes, dtype):
    # transformers' own block as from_pretrained builds it (its grouped experts), on 512 tokens:
    # each (token, slot) output kept apart, summed once per token. Adding them into zeros expert
    # by expert instead moves about half the elements at top-8 (in float32 too, by ~1e-7).
    import importlib

    config = _config(arch, hidden_size=256, intermediate_size=128, moe_intermediate_size=128, **changes)
    config._experts_implementation = "grouped_mm"  # what from_pretrained picks; a bare block has none
    module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    block_type = next(getattr(module, name) for name in dir(module) if name.endswith(("SparseMoeBlock", "MoeMoE")))
    torch.manual_seed(0)
    theirs = block_type(config)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.05)
    spec = ModelSpec.from_hf_config(config)
    ours = SparseMoE(spec, lambda size: MLP(spec.hidden_size, size))
    # Named as transformers 5 holds the layer (Granite-MoE's block is block_sparse_moe).
    block = "block_sparse_moe." if arch == "granitemoe" else "mlp."
    state = {"layers.0." + block + k: v.detach().clone() for k, v in theirs.state_dict().items()}
    ours.load("layers.0.", WeightReader(state, ModelError, ours))
    assert not state  # every tensor taken
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = torch.randn(512, 256).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x[None])[0])


def test_qwen3_moe_slides_on_every_layer_with_use_sliding_window():
    # Its config has no layer_types and no max_window_layers rule: transformers slides every
    # layer when use_sliding_window is on, and drops the window when it is off.
    on = ModelSpec.from_hf_config(_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                          use_sliding_window=True, sliding_window=8, max_window_layers=2))
    assert [on.window_of(i) for i in range(6)] == [8] * 6
    from transformers import AutoConfig

    off = AutoConfig.for_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, sliding_window=8)
    assert ModelSpec.from_hf_config(off).sliding_window is None


def test_qwen_moe_attention_as_transformers_builds_it():
    qwen2 = ModelSpec.from_hf_config(_config("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))
    qwen3 = ModelSpec.from_hf_config(_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and not qwen3.qkv_bias
    assert not ModelSpec.from_hf_config(_config("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                qkv_bias=False)).qkv_bias


@pytest.mark.parametrize("top_k", [0, 5])
def test_more_experts_a_token_than_there_are_is_refused(top_k):
    with pytest.raises(ModelError, match=f"num_experts_per_tok {top_k} must be from 1 to the number of experts, 4"):
        ModelSpec.from_hf_config(_config("mixtral", num_local_experts=4, num_experts_per_tok=top_k))


@pytest.mark.parametrize("arch", ARCHS)
def test_experts_named_as_transformers_5_holds_them_load_the_same(checkpoints, arch):
    # On disk each expert has its own matrices (Mixtral's w1/w3/w2 under block_sparse_moe); in
    # memory transformers 5 stacks them (mlp.experts.gate_up_proj [E, 2I, H]), which is what a
    # GGUF file converted through it is saved as.
    from backends.torch.loader import load_checkpoint

    checkpoint = load_checkpoint(checkpoints[arch])
    read = {t.untyped_storage().data_ptr() for t in checkpoint.weights.values()}
    # Built on the meta device, each parameter given its tensor (the engine's way) ...
    on_disk = CausalLM.from_state_dict(checkpoint.spec, 64, dict(checkpoint.weights))
    assert not any(p.is_meta for p in on_disk.parameters())
    # ... never a view of the file's mapping (which a rewrite of the file would break).
    assert not any(p.untyped_storage().data_ptr() in read for p in on_disk.parameters())
    # ... and copied into an ordinary model's parameters.
    stacked = CausalLM(checkpoint.spec, 64)
    state = {k: v.clone() for k, v in _hf_model(checkpoints[arch]).state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    stacked.load_hf_state_dict(state)
    theirs = dict(stacked.named_parameters())
    for name, p in on_disk.named_parameters():
        assert torch.equal(p, theirs[name]), name

    incomplete = {k: v for k, v in checkpoint.weights.items() if k != "model.norm.weight"}
    with pytest.raises(ModelError, match="checkpoint has no weight `norm.weight`"):
        CausalLM.from_state_dict(checkpoint.spec, 64, incomplete)

    bad = {k: v.clone() for k, v in checkpoint.weights.items()}
    for key in [k for k in bad if ".experts.3." in k]:
        bad[key.replace(".experts.3.", ".experts.11.")] = bad[key]
    with pytest.raises(ModelError, match=rf"weight `model\.layers\.\d\..*experts\.11\..*`: the checkpoint has more experts "
                                         rf"than the config's {checkpoint.spec.num_experts}"):
        CausalLM(checkpoint.spec, 64).load_hf_state_dict(bad)


def test_preemption_under_a_tiny_kv_budget_keeps_moe_outputs(checkpoints):
    folder = checkpoints["qwen3_moe"]
    block = 2 * 2 * 4 * 2 * 24 * 4  # layers x (k, v) x block_size x kv heads x head_dim x float32
    tight = small_steps_engine(folder, kv_cache_gb=12 * block / 2**30)
    assert tight.pool.num_blocks == 12
    prompts = random_prompts(3, (9, 14, 6, 11))
    try:
        squeezed = generate_all(tight, prompts, 24)
        assert tight.scheduler.preemptions > 0 and tight.pool.num_used == 0
    finally:
        run(tight.stop())
    assert squeezed == [hf_greedy(folder, p, 24) for p in prompts]


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def test_attention_adapters_on_a_mixture_of_experts_match_transformers_merged(checkpoints, tmp_path):
    from backends.torch import TorchConfig
    from backends.torch.setup import build_engine

    base = checkpoints["qwen3_moe"]
    adapter = write_lora(tmp_path / "ad", base, targets=ATTENTION)
    merged = merged_checkpoint(base, adapter, tmp_path / "merged")
    config = TorchConfig(name="t", backend="torch", path=str(base), max_model_len=512, kv_cache_gb=0.05,
                         block_size=4, max_batched_tokens=16)
    engine = build_engine(config, base, {"ad": adapter})
    prompts = random_prompts(4, [14, 6])
    try:
        async def gather():
            jobs = [(p, a) for p in prompts for a in (None, "ad")]
            return await asyncio.gather(*(generate(engine, p, 10, a) for p, a in jobs))

        outs = [out for out, _ in run(gather())]
    finally:
        run(engine.stop())
    for i, p in enumerate(prompts):
        assert outs[2 * i] == hf_greedy(base, p, 10)
        assert outs[2 * i + 1] == hf_greedy(merged, p, 10) != outs[2 * i]


@pytest.mark.parametrize("key,message", [
    ("layers.1.mlp.gate_proj", "layer 1's feed-forward block is a mixture of experts, which has no `gate_proj`"),
    ("layers.1.mlp.down_proj", "layer 1's feed-forward block is a mixture of experts, which has no `down_proj`"),
    ("layers.1.mlp.experts.0.up_proj", "the experts, shared expert and router of a mixture of experts cannot be adapted"),
    ("layers.1.mlp.gate", "the experts, shared expert and router of a mixture of experts cannot be adapted"),
])
def test_adapters_of_experts_are_refused_by_name(checkpoints, tmp_path, key, message):
    from safetensors.torch import load_file, save_file

    base = checkpoints["qwen3_moe"]  # layer 0 dense, layer 1 sparse
    folder = write_lora(tmp_path / "ad", base, targets=("q_proj",))
    spec = ModelSpec.from_hf_config(_hf_model(base).config)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    extra = {f"base_model.model.model.{key}.lora_A.weight": torch.zeros(4, 64),
             f"base_model.model.model.{key}.lora_B.weight": torch.zeros(128, 4)}
    save_file({**weights, **extra}, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=message):
        load_adapter("ad", folder, spec, torch.float32, torch.device("cpu"))
    # The dense layer's MLP can be adapted as in any model.
    dense = {"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": torch.zeros(4, 64),
             "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight": torch.zeros(128, 4)}
    save_file({**weights, **dense}, str(folder / "adapter_model.safetensors"))
    adapter = load_adapter("ad", folder, spec, torch.float32, torch.device("cpu"))
    assert (0, "gate_up_proj") in adapter.parts
