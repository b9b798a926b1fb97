"""Loading a checkpoint: config, tokenizer, chat template and weights, never from a hub.

Two sources: a Hugging Face folder (``config.json``, ``*.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``), or a GGUF file, dequantized through transformers' GGUF reader.
transformers is used for reading files only; the model code is :mod:`.model`.

Reading a GGUF through transformers parses the file several times and dequantizes it (about 45 s
for the bundled 135M model on 2 cores), so the first load converts it once into a Hugging Face
folder under the cache directory (``$ROUTER_CACHE_DIR``, else ``~/.cache/router``); later loads of
the same file (same path, size and modification time) read that folder in about a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from router.templates import hf_chat_template

from .model import ModelSpec
from .tokenizer import HFTokenizer

log = logging.getLogger("router.torch")

TRANSFORMERS = threading.RLock()
"""Held while transformers reads a config, tokenizer or GGUF file: its lazy modules import on
first use, and two models loading at once (each on its engine's thread) saw half-imported ones
("cannot import name 'AutoConfig' from 'transformers'"). A checkpoint's safetensors load outside
it; a GGUF file's first conversion (the whole model, once per file) inside."""


@dataclass
class Checkpoint:
    spec: ModelSpec
    weights: dict[str, torch.Tensor]
    tokenizer: HFTokenizer
    chat_template: str | None


def _eos_ids(*values: object) -> frozenset[int]:
    out: set[int] = set()
    for v in values:
        if isinstance(v, int):
            out.add(v)
        elif isinstance(v, (list, tuple)):
            out.update(x for x in v if isinstance(x, int))
    return frozenset(out)


def cache_dir() -> Path:
    return Path(os.environ.get("ROUTER_CACHE_DIR") or Path.home() / ".cache" / "router")


def cached_folder(kind: str, path: Path) -> Path:
    """Where under the cache directory what is made from the file ``path`` goes (``kind``: what
    it is made into); a changed file (size, modification time) gets a folder of its own."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    return cache_dir() / kind / f"{path.stem}-{key}"


def gguf_folder(path: Path) -> Path:
    """The Hugging Face folder a GGUF file converts to, converting it on first use."""
    folder = cached_folder("gguf", path)
    if (folder / "config.json").is_file():
        return folder
    with TRANSFORMERS:
        return _convert_gguf(path, folder)


GGUF_REFUSED = {
    "gemma2": "Gemma's rope scaling and query scale", "gemma3": "Gemma's rope scaling and query scale",
    "starcoder2": "StarCoder2's rope base and sliding window", "stablelm": "StableLM's rope base and rotated share",
    "nemotron": "Nemotron's rotated share and norm epsilon", "falcon": "Falcon's key-value heads and layout",
    "gpt2": "GPT-2's context length", "bloom": "a check of BLOOM's q, k and v rows",
}
"""GGUF architectures transformers' reader converts without settings their files carry (its
mapping has no key for them): a Gemma 3's rope scaling (4B and up), the 27B models' query scale
(llama.cpp derives both Gemmas' from the model's size), StarCoder2's rope base and window,
StableLM's and Nemotron's rotated share of each head, Falcon 40B's grouping; GPT-2's and
BLOOM's are unchecked. llama.cpp runs these files as they are (``backend = "llamacpp"``)."""


def gguf_architecture(path: Path) -> str | None:
    """A GGUF file's ``general.architecture`` (None if its first metadata does not say), read from
    the header alone: transformers' and gguf's readers parse every tensor's entry first (seconds)."""
    import struct

    with open(path, "rb") as f:
        head = f.read(1 << 16)
    key = b"general.architecture"
    at = head.find(struct.pack("<Q", len(key)) + key)
    if head[:4] != b"GGUF" or at < 0:
        return None
    at += 8 + len(key)
    kind, size = struct.unpack_from("<IQ", head, at)
    if kind != 8 or size > 256:  # 8: a string
        return None
    return head[at + 12 : at + 12 + size].decode("utf-8", "replace")


@contextlib.contextmanager
def _no_custom_code(path: Path, what: str, file: str) -> Iterator[None]:
    """Refuse, by name, a folder whose ``what`` needs the folder's own Python code (``auto_map``),
    which the engine never runs: transformers would ask whether to run it, or fail on its way."""
    try:
        yield
    except ValueError as exc:
        if "custom code" not in str(exc):
            raise
        try:
            settings = json.loads((path / file).read_text())
        except (OSError, ValueError):
            settings = {}
        name = settings.get("tokenizer_class") or settings.get("model_type") or "?"
        advice = ("give the folder a tokenizer.json (a fast tokenizer converted from it)" if what == "tokenizer"
                  else "the model is not one this engine runs")
        raise ValueError(f"{path}: its {what} (`{name}`) is custom code, which is not run; {advice}") from None


RETYPED = {"llama4_text": {"attn_temperature_tuning": bool}}
"""Config values some releases save in another type than transformers' strict configs accept, by
model type: Llama 4 Scout's and Maverick's ``attn_temperature_tuning`` is 4 (on), transformers 5
wants a bool."""


def _retyped_release_config(path: Path) -> dict | None:
    """The folder's ``config.json`` with the values :data:`RETYPED` names (at its top or in its
    ``text_config``) in the type transformers accepts; None where it has none of them (it is read
    as it is)."""
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    changed = False
    for section in (data, data.get("text_config") if isinstance(data, dict) else None):
        if not isinstance(section, dict):
            continue
        for key, kind in RETYPED.get(section.get("model_type"), {}).items():
            value = section.get(key)
            if value is not None and type(value) is not kind:
                section[key], changed = kind(value), True
    return data if changed else None


def _check_gguf_architecture(path: Path) -> None:
    arch = gguf_architecture(path)
    if arch in GGUF_REFUSED:
        raise ValueError(
            f"{path}: a {arch} GGUF file, which transformers' reader converts without {GGUF_REFUSED[arch]}; "
            f'serve its Hugging Face folder with the torch backend, or this file with backend = "llamacpp"'
        )


def _convert_gguf(path: Path, folder: Path) -> Path:
    if (folder / "config.json").is_file():  # converted by another thread meanwhile
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face folder (once) in %s", path, folder)
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    tok = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kwargs)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        from safetensors.torch import save_file

        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are dequantized now
        config.save_pretrained(tmp)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # safetensors refuses shared storage
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        if tok.chat_template and not (tmp / "chat_template.jinja").exists():
            (tmp / "chat_template.jinja").write_text(tok.chat_template, encoding="utf-8")
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint from a Hugging Face folder or a ``.gguf`` file."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with TRANSFORMERS:
        from transformers import AutoConfig, AutoTokenizer

        if path.is_file() and path.suffix == ".gguf":
            _check_gguf_architecture(path)
            path = gguf_folder(path)
        if not path.is_dir():
            raise FileNotFoundError(f"no model folder or .gguf file at {path}")
        with _no_custom_code(path, "config", "config.json"):
            released = _retyped_release_config(path)
            config = AutoConfig.for_model(**released) if released is not None else AutoConfig.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=False)
        spec = ModelSpec.from_hf_config(config)
        with _no_custom_code(path, "tokenizer", "tokenizer_config.json"):
            hf_tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False,
                                                   **({"config": config} if released is not None else {}))
    generation_eos = None
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        generation_eos = json.loads(gen_file.read_text()).get("eos_token_id")
    eos = _eos_ids(generation_eos, getattr(config, "eos_token_id", None), hf_tok.eos_token_id)
    template = hf_chat_template(path) or hf_tok.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    rename = _language_model_weight if getattr(config, "text_config", None) is not None else None
    model_type = getattr(config, "model_type", None)
    if model_type in _MODEL_NAMES:
        rename = _renamed(_MODEL_NAMES[model_type], rename, prefixes=True)
    if model_type in _RENAMED:
        rename = _renamed(_RENAMED[model_type], rename)
    weights = _safetensors_weights(path, rename)
    if model_type == "gpt2":  # its Conv1D layers hold their matrices [in, out]: as a Linear's, views
        weights.update({k: v.t() for k, v in weights.items() if v.dim() == 2 and k.startswith("model.layers.")})
    if model_type == "gpt_bigcode" and not getattr(config, "multi_query", True):  # c_attn's rows head by head
        weights = {k.replace(".self_attn.qkv_proj.", ".self_attn.query_key_value."): v for k, v in weights.items()}
    return Checkpoint(spec, weights, HFTokenizer(hf_tok, eos), template)


_LFM_MLP_NAMES = ((".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
                  (".feed_forward.w2.", ".mlp.down_proj."), ("model.embedding_norm.", "model.norm."))
"""The MLP and final norm of LFM2 and LFM3."""

_LFM2_NAMES = ((".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
               (".self_attn.out_proj.", ".self_attn.o_proj."), (".q_layernorm.", ".q_norm."),
               (".k_layernorm.", ".k_norm."), *_LFM_MLP_NAMES)
"""LFM2's norms, o_proj, q/k norms, MLP and final norm (its conv layers keep their names)."""

_LFM3_NAMES = ((".self_attn.gate_proj.", ".self_attn.g_proj."), (".operator_norm.", ".input_layernorm."),
               (".post_operator_norm.", ".post_attention_layernorm."), (".ffn_norm.", ".pre_feedforward_layernorm."),
               (".post_ffn_norm.", ".post_feedforward_layernorm."), *_LFM_MLP_NAMES)
"""LFM3's head gates (as released, ``gate_proj``), its norms as Gemma's sandwich (each block's input
norm, output norm: ``post_attention_layernorm`` and ``post_feedforward_layernorm``; the MLP's input
norm ``pre_feedforward_layernorm``), MLP and final norm."""

_BAMBA_NAMES = ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
                ("model.final_layernorm.", "model.norm."))
"""Bamba's and Falcon-H1's MLPs, their input norms and the final norm (their Mamba2 layers: ``mamba.``)."""

_GPT2_NAMES = ((".attn.c_attn.", ".self_attn.qkv_proj."), (".attn.c_proj.", ".self_attn.o_proj."),
               (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."), (".mlp.c_fc.", ".mlp.up_proj."),
               (".mlp.c_proj.", ".mlp.down_proj."))
"""GPT-2's and GPTBigCode's attention, norms and MLP."""

_FALCON_NAMES = ((".self_attention.dense.", ".self_attn.o_proj."), (".self_attention.", ".self_attn."),
                 (".mlp.dense_h_to_4h.", ".mlp.up_proj."), (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
                 (".ln_attn.", ".input_layernorm."), (".ln_mlp.", ".post_attention_layernorm."))

_RENAMED = {
    "lfm2": _LFM2_NAMES,
    "lfm3": _LFM3_NAMES,
    # LFM2-MoE: LFM2's names, its experts' choice bias, and its blocks of experts (`feed_forward.gate`,
    # `feed_forward.experts.E.w1` or as transformers 5 saves them, `feed_forward.experts.gate_up_proj`)
    # under `mlp.`
    "lfm2_moe": ((".feed_forward.expert_bias", ".mlp.e_score_correction_bias"), *_LFM2_NAMES,
                 (".feed_forward.", ".mlp.")),
    # Hunyuan: its query and key norms
    "hunyuan_v1_dense": ((".query_layernorm.", ".q_norm."), (".key_layernorm.", ".k_norm.")),
    # Hunyuan's experts: its router (`mlp.gate.wg`) and shared MLP (`mlp.shared_mlp.`) by our names
    "hunyuan_v1_moe": ((".query_layernorm.", ".q_norm."), (".key_layernorm.", ".k_norm."), (".mlp.gate.wg.", ".mlp.gate."),
                       (".mlp.shared_mlp.", ".mlp.shared_expert.")),
    # Nemotron-H: its embeddings and final norm, its blocks under `backbone.` (each block's `mixer.`
    # is named by its kind when the model loads: model._name_blocks)
    "nemotron_h": (("backbone.embeddings.", "model.embed_tokens."), ("backbone.norm_f.", "model.norm."),
                   ("backbone.", "model."), ("model.embeddings.", "model.embed_tokens."), ("model.norm_f.", "model.norm.")),
    "bamba": _BAMBA_NAMES,
    "falcon_h1": _BAMBA_NAMES,
    # OLMo Hybrid as released: its linear layers' input and MLP norms (its attention layers' output norm)
    "olmo_hybrid": ((".attention_layer_norm.", ".input_layernorm."), (".feedforward_layer_norm.", ".post_attention_layernorm.")),
    # Llama 4 (text, and image-text's language model): its MLPs and experts (`feed_forward.router`,
    # `.experts.gate_up_proj`, `.shared_expert.`)
    "llama4_text": ((".feed_forward.", ".mlp."),),
    "llama4": ((".feed_forward.", ".mlp."),),
    # VaultGemma: Gemma 2's layers without their output norms, the MLP's input norm by Gemma 2's name
    "vaultgemma": ((".pre_feedforward_layernorm.", ".post_attention_layernorm."),),
    # Apertus: its blocks' input norms
    "apertus": ((".attention_layernorm.", ".input_layernorm."), (".feedforward_layernorm.", ".post_attention_layernorm.")),
    # StarCoder2's ungated MLPs
    "starcoder2": ((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj.")),
    # StableLM's query and key norms (a LayerNorm a head: `q_layernorm.norms.H.`)
    "stablelm": ((".self_attn.q_layernorm.", ".self_attn.q_norm."), (".self_attn.k_layernorm.", ".self_attn.k_norm.")),
    # Phi: its o_proj, ungated MLP and final norm
    "phi": ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.up_proj."), (".mlp.fc2.", ".mlp.down_proj."),
            ("model.final_layernorm.", "model.norm.")),
    # GPT-NeoX's layers (once _MODEL_NAMES has named the model's parts): its attention (q, k and v
    # in one `query_key_value`, head by head) and ungated MLP
    "gpt_neox": ((".attention.dense.", ".self_attn.o_proj."), (".attention.", ".self_attn."),
                 (".mlp.dense_h_to_4h.", ".mlp.up_proj."), (".mlp.dense_4h_to_h.", ".mlp.down_proj.")),
    # Falcon's layers: its attention (q, k and v in one `query_key_value`, by key-value group),
    # ungated MLP, and 40B's two norms (`ln_attn`, `ln_mlp`); BLOOM's the same (a group a head)
    "falcon": _FALCON_NAMES,
    "bloom": _FALCON_NAMES,
    # MPT's blocks: its norms, attention (q, k and v in one `Wqkv`, as ours) and MLP
    "mpt": ((".norm_1.", ".input_layernorm."), (".norm_2.", ".post_attention_layernorm."),
            (".attn.Wqkv.", ".self_attn.qkv_proj."), (".attn.out_proj.", ".self_attn.o_proj."), (".ffn.", ".mlp.")),
    # GPT-J's layers: its attention's o_proj and the rest of it, norm and ungated MLP
    "gptj": ((".attn.out_proj.", ".self_attn.o_proj."), (".attn.", ".self_attn."), (".ln_1.", ".input_layernorm."),
             (".mlp.fc_in.", ".mlp.up_proj."), (".mlp.fc_out.", ".mlp.down_proj.")),
    # GPT-2's and GPTBigCode's layers: q, k and v in one `c_attn` (as ours: all q rows, then k's, v's)
    "gpt2": _GPT2_NAMES,
    "gpt_bigcode": _GPT2_NAMES,
    # OPT's layers: its norms (the MLP's `final_layer_norm`), o_proj and MLP
    "opt": ((".self_attn_layer_norm.", ".input_layernorm."), (".final_layer_norm.", ".post_attention_layernorm."),
            (".self_attn.out_proj.", ".self_attn.o_proj."), (".fc1.", ".mlp.up_proj."), (".fc2.", ".mlp.down_proj.")),
}
"""Model types whose weights are read by the names a Llama checkpoint gives their counterparts:
(theirs, ours) parts of a name."""


_GPT2_MODEL = tuple((prefix + theirs, ours) for prefix in ("transformer.", "") for theirs, ours in (
    ("wte.", "model.embed_tokens."), ("wpe.", "model.embed_positions."), ("ln_f.", "model.norm."), ("h.", "model.layers.")))

_MODEL_NAMES = {
    "gpt_neox": (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
                 ("gpt_neox.", "model."), ("embed_out.", "lm_head.")),
    "falcon": (("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
               ("transformer.h.", "model.layers.")),
    "gptj": (("transformer.wte.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."), ("transformer.h.", "model.layers.")),
    # GPT-2's and GPTBigCode's (GPT-2's first releases without the `transformer.`)
    "gpt2": _GPT2_MODEL,
    "gpt_bigcode": _GPT2_MODEL,
    # OPT's decoder (its first releases without the `model.`), and its final norm
    "opt": tuple((prefix + theirs, ours) for prefix in ("model.", "") for theirs, ours in (
        ("decoder.final_layer_norm.", "model.norm."), ("decoder.", "model."))),
    # BLOOM's (its releases without the `transformer.`): its embeddings and their norm
    "bloom": tuple((prefix + theirs, ours) for prefix in ("transformer.", "") for theirs, ours in (
        ("word_embeddings_layernorm.", "model.embed_norm."), ("word_embeddings.", "model.embed_tokens."),
        ("ln_f.", "model.norm."), ("h.", "model.layers."))),
    "mpt": (("transformer.wte.", "model.embed_tokens."), ("transformer.norm_f.", "model.norm."),
            ("transformer.blocks.", "model.layers.")),
}
"""Model types whose whole model is named otherwise (each a prefix of a weight's name), before
_RENAMED renames within its layers."""


def _renamed(names: tuple[tuple[str, str], ...], first: Callable[[str], str | None] | None = None,
             prefixes: bool = False) -> Callable[[str], str | None]:
    """A weight's name with the first of ``names``' parts it holds replaced (``prefixes``: the
    first it begins with), after ``first``, an image-text checkpoint's renaming to its language
    model's names (None stays None)."""
    def rename(key: str) -> str | None:
        if first is not None and (key := first(key)) is None:
            return None
        for theirs, ours in names:
            if key.startswith(theirs) if prefixes else theirs in key:
                return ours + key[len(theirs):] if prefixes else key.replace(theirs, ours)
        return key

    return rename


_LANGUAGE_MODEL = (("language_model.model.", "model."), ("model.language_model.", "model."), ("language_model.", ""))
_TEXT_KEYS = ("lm_head.", "model.layers.", "model.embed_tokens.", "model.norm.")


def _language_model_weight(key: str) -> str | None:
    """An image-text checkpoint's (Gemma 3 from 4B up, Mistral 3, Qwen-VL) weight by its
    language model's name, as a text-only checkpoint names it (``language_model.model.layers.0...``
    as saved, ``model.language_model.layers.0...`` as transformers 5 holds it, ``model.layers.0...``
    as Qwen2.5-VL's releases beside their ``visual.``); None for the vision tower and projector,
    which are never read."""
    for prefix, name in _LANGUAGE_MODEL:
        if key.startswith(prefix):
            return name + key[len(prefix):]
    return key if key.startswith(_TEXT_KEYS) else None


INDEX = "model.safetensors.index.json"
"""The file naming which safetensors files hold a sharded checkpoint's weights."""


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding a folder's weights: those its index names (``INDEX``), else
    every ``*.safetensors`` but Mistral's ``consolidated*.safetensors`` where others are there
    too. Mistral's repositories carry their weights twice, in Hugging Face's names and in
    Mistral's own (``consolidated.safetensors``); reading both would map the model twice, and
    Mistral's ``norm.weight`` would stand for Hugging Face's ``model.norm.weight``."""
    index = folder / INDEX
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
            if not shards or not all(isinstance(n, str) and n and Path(n).name == n for n in shards):
                raise ValueError("`weight_map` must map weight names to file names in the folder")
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index (a `weight_map` of names to files): {e}") from None
        files = sorted(folder / name for name in shards)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names files that are not in {folder}: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    theirs = [f for f in files if not f.name.startswith("consolidated")]
    return theirs or files


def _safetensors_weights(folder: Path, rename: Callable[[str], str | None] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files (:func:`weight_files`) by name; with ``rename``,
    by the name it gives, leaving out (and never reading) those it gives None. Multi-token
    prediction layers (Qwen3-Next's and Qwen3.5's ``mtp.``), which the engine does not run, are
    never read either."""
    from safetensors import safe_open

    files = weight_files(folder)
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as reader:
            for key in reader.keys():
                if key.startswith("mtp."):
                    continue
                name = rename(key) if rename is not None else key
                if name is not None:
                    weights[name] = reader.get_tensor(key)
    return weights
