"""FP8 checkpoints (``quantization_config`` quant_method ``fp8``, e4m3): float8 weights with their
``weight_scale_inv``, per block (DeepSeek-V3's and Qwen3's FP8 releases) or one per tensor with
static activation scales (Mistral's), decoded as they load. Greedy output and prompt logprobs
against transformers on the same files (which decodes them itself on a CPU), the decoding
against a block-by-block reference, and what is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from backends.torch.model import ModelError, ModelSpec
from backends.torch.weights import dequantize_fp8
from test_torch_engine import assert_greedy_matches_transformers
from test_torch_gemma import distance, engine_prompt_logprobs, hf_prompt_logprobs
from torch_models import tiny_checkpoint

E4M3_MAX = 448.0
KEPT = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "vision_tower", "multi_modal_projector")
"""What the FP8 releases leave unquantized: all but the language model's projections."""


def fp8_checkpoint(src, out, block):
    """``src``'s projections as e4m3 with float32 ``weight_scale_inv`` (absmax / 448) per block of
    ``block`` rows and columns, or one per tensor (``block`` None) with an activation scale
    beside it, as Mistral's FP8 releases hold them."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    for key in [k for k, v in state.items() if k.endswith(".weight") and v.dim() == 2 and not any(x in k for x in KEPT)]:
        w = state[key].float()
        if block is None:
            scale = w.abs().max().clamp(min=1e-12) / E4M3_MAX
            full = scale
            state[key.removesuffix("weight") + "activation_scale"] = torch.tensor(0.02)
        else:
            rows, cols = w.shape
            grid = w.reshape(rows // block[0], block[0], cols // block[1], block[1])
            scale = grid.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
            full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        state[key] = (w / full).to(torch.float8_e4m3fn)
        state[key + "_scale_inv"] = scale.float()
    shutil.copytree(src, out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block,
                                     "activation_scheme": "dynamic" if block else "static",
                                     "modules_to_not_convert": ["lm_head", "gate", "vision_tower",
                                                                "multi_modal_projector"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


CASES = {"llama": [16, 32], "qwen3": [8, 16], "qwen3_moe": [8, 8], "ministral3": None, "deepseek_v3": [8, 8],
         "falcon_h1": [4, 8]}
"""Each model and its scales' block (None: one a tensor). Falcon-H1: its multipliers fold into the decoded weights."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {arch: fp8_checkpoint(tiny_checkpoint(root / arch, arch), root / f"{arch}-fp8", block)
            for arch, block in CASES.items()}


@pytest.mark.parametrize("arch", sorted(CASES))
def test_greedy_matches_transformers_on_the_fp8_files(checkpoints, arch):
    # transformers decodes FP8 weights itself where there is no GPU (its dequantize): both read
    # the same files. llama: blocks of 16 x 32; qwen3: 8 x 16; qwen3_moe: the experts' too,
    # the router kept; ministral3: one scale a tensor, static activation scales (unused).
    folder = checkpoints[arch]
    assert ModelSpec.from_hf_config(_hf_config(folder)).fp8_weights
    assert_greedy_matches_transformers(folder)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_prompt_logprobs_match_transformers_on_the_fp8_files(checkpoints, arch):
    folder = checkpoints[arch]
    prompt, got = engine_prompt_logprobs(folder)
    # Measured about 1e-6: the same float32 products; far from the unquantized model's.
    assert distance(got, hf_prompt_logprobs(folder, prompt)) < 1e-4
    assert distance(got, hf_prompt_logprobs(folder.with_name(arch), prompt)) > 1e-3


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_fp8_files_pack_into_the_cpu_formats(checkpoints, fmt):
    """Decoded, then packed like any checkpoint: the C step serves them."""
    from test_torch_gemma import assert_c_steps_match_the_torch_path

    assert_c_steps_match_the_torch_path(checkpoints["qwen3"], weight_format=fmt)


def _hf_config(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


@pytest.mark.parametrize("shape,block", [((10, 7), (4, 3)), ((3, 8, 8), (4, 4)), ((5, 9), (5, 9)), ((6, 4), (8, 8))])
def test_dequantize_fp8_by_blocks_partial_ones_too(shape, block):
    torch.manual_seed(0)
    q = (torch.randn(shape) * 50).to(torch.float8_e4m3fn)
    grid = (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    scale = torch.rand(*shape[:-2], *grid) + 0.1
    got = dequantize_fp8(q, scale, block)
    want = torch.empty(shape)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in shape)).tolist():
        *lead, r, c = idx
        want[tuple(idx)] = q[tuple(idx)].float() * scale[(*lead, r // block[0], c // block[1])]
    assert torch.equal(got, want)


@pytest.mark.parametrize("scale_shape", [(3,), (3, 1, 1), (3, 2, 1)])
def test_dequantize_fp8_stacked_experts_by_expert(scale_shape):
    """Stacked experts [E, 2I, H] without a block size: a scale an expert, or one for each of an
    expert's gate and up halves (Mistral 4's FP8 release)."""
    torch.manual_seed(0)
    q = (torch.randn(3, 8, 5) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_shape) + 0.1
    full = scale.reshape(3, -1, 1).repeat_interleave(8 // scale.reshape(3, -1, 1).shape[1], dim=1)
    assert torch.equal(dequantize_fp8(q, scale, None), q.float() * full)
    with pytest.raises(ValueError, match="no weight_block_size"):  # tiles that do not divide an expert
        dequantize_fp8(q, torch.ones(3, 3, 1), None)


def test_dequantize_fp8_one_scale_and_the_wrong_scales():
    q = torch.tensor([[1.5, -2.0], [448.0, 0.0]]).to(torch.float8_e4m3fn)
    assert torch.equal(dequantize_fp8(q, torch.tensor(0.5), None), torch.tensor([[0.75, -1.0], [224.0, 0.0]]))
    assert torch.equal(dequantize_fp8(q, torch.tensor([[2.0]]), (128, 128)), q.float() * 2)
    with pytest.raises(ValueError, match=r"scales of shape \(2, 2\) for blocks of \[1, 2\] of a \(2, 2\) tensor"):
        dequantize_fp8(q, torch.ones(2, 2), (1, 2))
    with pytest.raises(ValueError, match="4 scales for a tensor, and no weight_block_size"):
        dequantize_fp8(q, torch.ones(2, 2), None)


def test_what_fp8_checkpoints_are_refused_for(checkpoints, tmp_path):
    from backends.torch.loader import load_checkpoint
    from backends.torch.model import CausalLM
    from safetensors.torch import load_file, save_file

    src = checkpoints["llama"]
    broken = shutil.copytree(src, tmp_path / "no-scale")
    state = load_file(str(broken / "model.safetensors"))
    del state["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    ckpt = load_checkpoint(broken)
    with pytest.raises(ModelError, match="FP8 weight `model.layers.0.self_attn.q_proj.weight` has no "
                                         "`model.layers.0.self_attn.q_proj.weight_scale_inv` beside it"):
        CausalLM.from_state_dict(ckpt.spec, 64, dict(ckpt.weights))
    # FP8 tensors under a config that does not say so.
    plain = shutil.copytree(src, tmp_path / "no-config")
    config = json.loads((plain / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    ckpt = load_checkpoint(plain)
    with pytest.raises(ModelError, match="is FP8 .*but the config has no FP8 quantization_config"):
        CausalLM.from_state_dict(ckpt.spec, 64, dict(ckpt.weights))


def test_fp8_specs():
    from types import SimpleNamespace

    base = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_theta=1e4)
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    s = ModelSpec.from_hf_config(SimpleNamespace(**base, quantization_config=quant))
    assert s.fp8_weights and s.fp8_block == (128, 128)
    tensor = ModelSpec.from_hf_config(SimpleNamespace(**base, quantization_config={**quant, "weight_block_size": None}))
    assert tensor.fp8_weights and tensor.fp8_block is None
    assert not ModelSpec.from_hf_config(SimpleNamespace(**base)).fp8_weights
    for bad in ([128], [0, 128], [128.0, 128], "128"):
        with pytest.raises(ModelError, match="weight_block_size .* must be two positive integers or null"):
            ModelSpec.from_hf_config(SimpleNamespace(**base, quantization_config={**quant, "weight_block_size": bad}))


def test_a_ministral3_image_text_release_in_fp8(tmp_path):
    """Ministral 3 Instruct as released: an image-text checkpoint (``mistral3``) whose language
    model's projections are FP8 with one scale a tensor and static activation scales, its vision
    tower unquantized: its language model against transformers' image-text model on the files."""
    from transformers import AutoModelForImageTextToText

    folder = fp8_checkpoint(tiny_checkpoint(tmp_path / "mm", "mistral3-mm"), tmp_path / "mm-fp8", None)
    prompt, got = engine_prompt_logprobs(folder)
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        lp = model(input_ids=torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    assert distance(got, lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()) < 1e-4  # measured 1e-6
