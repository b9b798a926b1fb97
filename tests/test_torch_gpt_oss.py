"""gpt-oss on the torch engine: greedy output and prompt logprobs against transformers (float32
and bfloat16), its experts read from MXFP4 as the released checkpoints hold them, int4 on the
CPU, and what its config says."""

from __future__ import annotations

import shutil

import pytest
import torch

from backends.torch.model import ModelSpec
from backends.torch.moe import SparseMoE
from backends.torch.quantize import PackedLinear
from backends.torch.weights import dequantize_mxfp4
from test_torch_engine import assert_greedy_matches_transformers, generate_all, random_prompts, run, small_steps_engine
from test_torch_gemma import assert_c_steps_match_the_torch_path, distance, hf_prompt_logprobs, prompt_logprobs
from test_torch_moe import _rounded
from torch_models import _hf_model, gpt_oss_mxfp4, hf_greedy, mxfp4_quantize, tiny_checkpoint


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "float", "gpt_oss")


def test_greedy_matches_transformers_alone_and_in_a_mixed_batch(gpt_oss):
    # 4 experts, 2 a token, routed by the softmax of the two best logits (router bias); experts
    # with biases and a SwiGLU clamped at 0.25 (these weights' gates pass it); a sink per head;
    # a window of 8 on layer 0; YaRN; q/k/v/o biases.
    assert_greedy_matches_transformers(gpt_oss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_logprobs_match_transformers(gpt_oss, dtype):
    engine = small_steps_engine(gpt_oss, dtype=str(dtype).removeprefix("torch."))
    try:
        prompt = random_prompts(4, (40,))[0]
        got = run(prompt_logprobs(engine, prompt))
    finally:
        run(engine.stop())
    # Measured: about 1e-6 apart in float32, 0.004 in bfloat16 (not bit for bit there: some
    # roundings come in another order). The sinks' softmax in the scores' dtype and the routing
    # weights in the model's, as transformers has them.
    assert distance(got, hf_prompt_logprobs(gpt_oss, prompt, dtype)) < (1e-4 if dtype == torch.float32 else 0.01)


@pytest.mark.parametrize("change", ["sinks", "clamp", "router bias", "expert biases"])
def test_the_tiny_config_exercises_what_it_sets(gpt_oss, tmp_path, change):
    """Each part the comparisons above rely on changes transformers' own answer when taken away."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gpt_oss), dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (change == "sinks" and name.endswith(".sinks")) or (change == "router bias" and name.endswith("router.bias")) \
                    or (change == "expert biases" and name.endswith("_proj_bias")):
                p.zero_()
    if change == "clamp":
        for layer in model.model.layers:
            layer.mlp.experts.limit = 100.0
    changed = tmp_path / "changed"
    model.save_pretrained(changed)
    if change == "clamp":
        (changed / "config.json").write_text((changed / "config.json").read_text().replace('"swiglu_limit": 0.25', '"swiglu_limit": 100.0'))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gpt_oss / name, changed / name)
    prompt = random_prompts(4, (40,))[0]
    assert distance(hf_prompt_logprobs(gpt_oss, prompt), hf_prompt_logprobs(changed, prompt)) > 0.05


def test_mxfp4_decodes_as_transformers_decodes_it():
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 6, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 134, (2, 6, 4), generator=g, dtype=torch.uint8)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_mxfp4(blocks, scales, dtype)
        assert ours.dtype == dtype and torch.equal(ours.float(), theirs.transpose(1, 2))  # exact in both
    w = torch.randn(3, 5, 64, generator=g)
    assert (dequantize_mxfp4(*mxfp4_quantize(w), torch.float32) - w).abs().max() < 0.7  # the test's own quantizer
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :3], torch.float32)


def test_an_mxfp4_checkpoint_gives_transformers_output_on_its_weights(gpt_oss, tmp_path):
    packed, reference = gpt_oss_mxfp4(gpt_oss, tmp_path / "mxfp4", tmp_path / "reference")
    engine = small_steps_engine(packed)
    try:
        prompts = random_prompts(1, (5, 23, 40, 11))
        outs = generate_all(engine, prompts, 20)
        logprobs = run(prompt_logprobs(engine, prompts[2]))
    finally:
        run(engine.stop())
    assert outs == [hf_greedy(reference, p, 20) for p in prompts]
    assert distance(logprobs, hf_prompt_logprobs(reference, prompts[2])) < 1e-4
    # The rounding to MXFP4 matters: the float checkpoint answers otherwise.
    assert outs != [hf_greedy(gpt_oss, p, 20) for p in prompts]


def _int4_reference(folder, out):
    """The checkpoint with what int4 rounds rounded as it rounds it: attention's projections and
    each expert's matrices at 4 bits (the experts held as [E, in, out]), the LM head at 8;
    embeddings, norms, sinks, biases and the router as they are."""
    model = _hf_model(folder)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key, p in state.items():
        if key == "lm_head.weight":
            state[key] = _rounded(p, 8)
        elif p.dim() == 3:
            state[key] = torch.stack([_rounded(p[e].T.contiguous(), 4).T for e in range(p.shape[0])])
        elif p.dim() == 2 and not key.endswith("bias") and "embed" not in key and "router" not in key:
            state[key] = _rounded(p, 4)
    rounded = type(model)(model.config)
    rounded.load_state_dict(state)
    rounded.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, out / name)
    return out


def test_int4_gives_transformers_output_on_the_rounded_weights(gpt_oss, tmp_path):
    engine = small_steps_engine(gpt_oss, weight_format="int4")
    try:
        moe = next(layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, SparseMoE))
        expert = moe.experts[0]
        assert isinstance(expert.gate_up_proj, PackedLinear) and expert.gate_up_proj.bits == 4
        assert expert.gate_up_proj._bias is not None and expert.down_proj._fp16 is None
        assert type(moe.gate) is torch.nn.Linear and moe.gate.bias is not None  # the router stays float32
        assert engine.runner.decoder is not None  # the steps in one C call, sinks and experts included
        prompts = random_prompts(1, (5, 23, 40, 11))
        outs = generate_all(engine, prompts, 20)
    finally:
        run(engine.stop())
    reference = _int4_reference(gpt_oss, tmp_path / "rounded")
    assert outs == [hf_greedy(reference, p, 20) for p in prompts]


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_c_steps_match_the_packed_torch_path(gpt_oss, fmt):
    """The one C call per step computes gpt-oss as CausalLM.forward does: the sinks in every
    softmax of the attention, the router's bias, the softmax of the top-k logits, the experts'
    biases and clamped SwiGLU (tokens; logprobs within 0.02, measured: at most 5e-5 apart)."""
    assert_c_steps_match_the_torch_path(gpt_oss, weight_format=fmt)
    # A 300-token prompt in one step: the router's rows split between threads (300 x 4 experts x
    # 64 above 65,536), each expert's rows in the wide matmul loop, the sinks over long rows.
    assert_c_steps_match_the_torch_path(gpt_oss, lengths=(300, 9, 40), weight_format=fmt, max_batched_tokens=320)


def test_spec_of_gpt_oss_20b():
    from transformers import GptOssConfig

    spec = ModelSpec.from_hf_config(GptOssConfig(num_hidden_layers=24, num_local_experts=32))
    assert (spec.num_experts, spec.experts_per_token, spec.expert_size) == (32, 4, 2880)
    assert spec.attention_sinks and spec.router_bias and spec.softmax_top_k and spec.expert_bias
    assert spec.clamped_swiglu == (1.702, 7.0) and spec.float_norms and spec.qkv_bias and spec.o_bias
    assert [i for i in range(6) if spec.window_of(i)] == [0, 2, 4] and spec.sliding_window == 128
    assert spec.rope_scaling["rope_type"] == "yarn" and spec.rope_scaling["truncate"] is False
    assert spec.context_length == 131072 and not spec.tie_word_embeddings
