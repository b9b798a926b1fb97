"""PEFT LoRA folders as both local engines read them: the config's checks and the weights' keys.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors``. The adapter adds
``s B (A x)`` to some projections, with ``A`` of shape ``[r, in]``, ``B`` of ``[out, r]`` and
``s = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA). What each engine does with the weights is its
own (backends/torch/lora.py adds them in its steps; backends/llamacpp/lora.py writes them as a
llama.cpp adapter file); the options neither serves are refused here, by name.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable


class AdapterError(ValueError):
    """An adapter this engine cannot serve (the message names the adapter and what is wrong)."""


KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp|feed_forward)\.(\w+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
"""A layer's projection's weight: groups (layer, PEFT module name, ``A`` or ``B``); Llama 4 names its
MLPs ``feed_forward``."""

_UNSUPPORTED = {
    "use_dora": "DoRA (`use_dora`)",
    "modules_to_save": "`modules_to_save` (fully trained extra modules)",
    "layers_to_transform": "`layers_to_transform`",
    "rank_pattern": "per-module ranks (`rank_pattern`)",
    "alpha_pattern": "per-module alphas (`alpha_pattern`)",
    "fan_in_fan_out": "`fan_in_fan_out` (Conv1D-style weights)",
    "lora_bias": "trained biases on lora_B (`lora_bias`)",
    "trainable_token_indices": "trained token embeddings (`trainable_token_indices`)",
}


@dataclass(frozen=True)
class PeftFolder:
    """A checked PEFT LoRA folder: its rank, the scale of ``B``, and the weights file."""

    name: str
    folder: Path
    rank: int
    scale: float

    @property
    def weights_file(self) -> Path:
        return self.folder / "adapter_model.safetensors"

    def error(self, why: str) -> AdapterError:
        return AdapterError(f"LoRA adapter `{self.name}` ({self.folder}): {why}")

    def locate(self, key: str, modules: Iterable[str], layers: int) -> tuple[int, str, str]:
        """Weight ``key``'s (layer, PEFT module name, ``A`` or ``B``); refuses a weight of any
        other module than ``modules``, or of a layer the base model (``layers``) lacks."""
        m = KEY.search(key)
        if m is None:
            raise self.error(f"weight `{key}`: only the layers' projections can be adapted (q/k/v/o, gate/up/down)")
        layer, module, side = int(m.group(1)), m.group(2), m.group(3)
        if module not in modules:
            raise self.error(f"weight `{key}`: module `{module}` is not supported; supported: {', '.join(modules)}")
        if layer >= layers:
            raise self.error(f"weight `{key}`: the base model has {layers} layers")
        return layer, module, side

    def paired(self, found: dict[tuple[int, str], dict[str, Any]],
               shape: Callable[[str], tuple[int, int]]) -> list[tuple[int, str, Any, Any]]:
        """``found``'s weights (by (layer, module), then ``A`` / ``B``) as (layer, module, A, B)
        in order; refuses none at all, an ``A`` or ``B`` without its pair, and shapes other than
        ``[r, in]`` and ``[out, r]`` for the base weight's ``shape(module)`` (out, in)."""
        if not found:
            raise self.error("adapter_model.safetensors holds no LoRA weights")
        out = []
        for (layer, module), pair in sorted(found.items()):
            if set(pair) != {"A", "B"}:
                raise self.error(f"layer {layer} `{module}` has lora_{''.join(pair)} without its pair")
            a, b = pair["A"], pair["B"]
            out_features, in_features = shape(module)
            if tuple(a.shape) != (self.rank, in_features) or tuple(b.shape) != (out_features, self.rank):
                raise self.error(
                    f"layer {layer} `{module}`: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, expected "
                    f"{(self.rank, in_features)} and {(out_features, self.rank)} (r = {self.rank} on this base model)"
                )
            out.append((layer, module, a, b))
        return out


def read_peft_folder(name: str, folder: Path) -> PeftFolder:
    """Check ``folder``'s adapter_config.json (and that its weights file exists); raises
    :class:`AdapterError` naming what is missing or not supported."""

    def fail(why: str) -> AdapterError:
        return AdapterError(f"LoRA adapter `{name}` ({folder}): {why}")

    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise fail("no adapter_config.json (a PEFT LoRA folder is expected)")
    if not weights_file.is_file():
        raise fail("no adapter_model.safetensors (adapters saved as .bin are not read; save with safetensors)")
    try:
        config = json.loads(config_file.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise fail(f"adapter_config.json is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise fail("adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type `{config.get('peft_type')}` is not supported; only LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise fail(f"{what} is not supported")
    if config.get("bias", "none") != "none":
        raise fail(f"bias `{config['bias']}` is not supported; only \"none\" (no trained biases)")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise fail("adapter_config.json needs an integer `r` >= 1 and a number `lora_alpha`")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return PeftFolder(name, folder, rank, scale)
