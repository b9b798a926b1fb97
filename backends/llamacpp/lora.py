"""LoRA adapters for llama.cpp: its own GGUF adapter files, and PEFT folders written as one.

llama.cpp adds an adapter's product ``s B (A x)`` inside its graph, from a GGUF file whose
``general.type`` is ``adapter`` (what llama.cpp's ``convert_lora_to_gguf.py`` writes): tensors
``blk.N.attn_q.weight.lora_a`` (``A``, ``[r, in]``) and ``.lora_b`` (``B``, ``[out, r]``) next to
each base tensor they adapt, and ``adapter.lora.alpha``, the scale being ``alpha / r`` (1 where
alpha is 0). A PEFT folder (what vLLM's ``--lora-modules`` takes, and the torch backend) is
written as such a file here, for a base model of an architecture in :data:`CONVERTED_ARCHITECTURES`
(Llama, SmolLM, Mistral; Qwen2 and 2.5; Qwen3): each PEFT module is named as llama.cpp names the
base tensor and the scale is folded into ``B`` (alpha 0). For ``llama`` the query and key rows
of ``B`` are also permuted as the GGUF converter permutes the base model's (there llama.cpp's
rotary embedding pairs neighbouring dimensions, Hugging Face's the two halves; Qwen's GGUF files
keep Hugging Face's halves). Other architectures take an adapter file converted by llama.cpp's
own script; for the architectures above, its tensors' shapes are checked here first.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.peft import AdapterError, read_peft_folder

# PEFT's module names -> llama.cpp's base tensor names (``blk.N.<name>.weight``).
TENSORS = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}

CONVERTED_ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}
"""Base architectures (GGUF ``general.architecture``) whose PEFT adapters are converted here, the
tensor names above being theirs, each with whether its GGUF converter pairs the query and key
rows for llama.cpp's rotary embedding (and the adapter's ``B`` must be permuted alike)."""


@dataclass(frozen=True)
class BaseModel:
    """What an adapter must fit, read from the base GGUF's metadata."""

    architecture: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> BaseModel:
        arch = meta["general.architecture"]

        def get(key: str, default: int | None = None) -> int:
            value = meta.get(f"{arch}.{key}")
            if value is None:
                if default is None:
                    raise KeyError(f"{arch}.{key}")
                return default
            return int(value)

        hidden, heads = get("embedding_length"), get("attention.head_count")
        return cls(
            architecture=arch,
            layers=get("block_count"),
            hidden=hidden,
            intermediate=get("feed_forward_length"),
            heads=heads,
            kv_heads=get("attention.head_count_kv", heads),
            head_dim=get("attention.key_length", hidden // heads),
        )

    def shapes(self, module: str) -> tuple[int, int]:
        """(out, in) of a PEFT module's base weight."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        return {
            "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
        }[module]


def adapter_file(name: str, path: Path, base: BaseModel, workdir: Path) -> Path:
    """The GGUF adapter file to give llama.cpp for ``path``: the file itself (checked to be a
    LoRA adapter of ``base``'s architecture), or a PEFT folder converted into ``workdir``."""
    if path.is_dir():
        # Named by tempfile, not by the adapter's name (which may hold "/" or "..").
        fd, file = tempfile.mkstemp(suffix=".gguf", dir=workdir)
        os.close(fd)
        out = Path(file)
        try:
            write_gguf_adapter(name, path, base, out)
        except BaseException:
            out.unlink()
            raise
        return out
    if not path.is_file():
        raise AdapterError(f"LoRA adapter `{name}` ({path}): no such file or folder (a GGUF adapter file or a "
                           "PEFT LoRA folder is expected)")
    check_gguf_adapter(name, path, base)
    return path


def check_gguf_adapter(name: str, path: Path, base: BaseModel) -> None:
    """Refuse, by name, a file that is not a GGUF LoRA adapter for ``base`` (llama.cpp's own
    refusal reaches only its log)."""
    from gguf import GGUFReader

    def fail(why: str) -> AdapterError:
        return AdapterError(f"LoRA adapter `{name}` ({path}): {why}")

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - GGUFReader raises ValueError and others on a bad file
        raise fail(f"not a GGUF file ({exc})") from None
    fields = reader.fields

    def text(key: str) -> str | None:
        field = fields.get(key)
        return None if field is None else field.contents()

    if text("general.type") != "adapter" or text("adapter.type") != "lora":
        raise fail("not a LoRA adapter (its general.type must be `adapter` and adapter.type `lora`)")
    if text("general.architecture") != base.architecture:
        raise fail(f"an adapter of a `{text('general.architecture')}` model; the base model is `{base.architecture}`")
    if base.architecture in CONVERTED_ARCHITECTURES:  # whose projections' shapes BaseModel knows
        _check_tensor_shapes(reader.tensors, base, fail)


_GGUF_MODULES = {gguf: peft for peft, gguf in TENSORS.items()}


def _check_tensor_shapes(tensors, base: BaseModel, fail) -> None:
    """Refuse an adapter whose A and B of a layer's projection do not fit the base weight ([r, in]
    and [out, r], one rank), or come without each other: llama.cpp's own refusal reaches only its
    log. Tensors of other names (llama.cpp may adapt more than the projections) are left to it."""
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for tensor in tensors:
        stem, _, side = tensor.name.rpartition(".lora_")
        if side in ("a", "b"):
            shapes.setdefault(stem, {})[side] = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if not shapes:
        raise fail("it holds no LoRA tensors (`<base tensor>.lora_a` and `.lora_b`)")
    for stem, pair in sorted(shapes.items()):
        if len(pair) == 1:
            raise fail(f"`{stem}.lora_{next(iter(pair))}` comes without its pair")
        parts = stem.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_MODULES or parts[3] != "weight":
            continue
        if not parts[1].isdigit() or int(parts[1]) >= base.layers:
            raise fail(f"`{stem}`: the base model has layers 0 to {base.layers - 1}")
        out, into = base.shapes(_GGUF_MODULES[parts[2]])
        a, b = pair["a"], pair["b"]
        if len(a) != 2 or len(b) != 2 or a[1] != into or b[0] != out or a[0] != b[1]:
            raise fail(f"`{stem}`: lora_a is {list(pair['a'])} and lora_b {list(pair['b'])}; this base model's "
                       f"weight is [{out}, {into}], so [r, {into}] and [{out}, r] are expected")


def write_gguf_adapter(name: str, folder: Path, base: BaseModel, out: Path) -> None:
    """Write PEFT folder ``folder`` as a llama.cpp adapter file (module docstring)."""
    from gguf import GGUFWriter

    peft = read_peft_folder(name, folder)
    fail = peft.error
    if base.architecture not in CONVERTED_ARCHITECTURES:
        raise fail(f"PEFT folders are converted for base models of the {', '.join(CONVERTED_ARCHITECTURES)} "
                   f"architecture, not `{base.architecture}`; convert it with llama.cpp's convert_lora_to_gguf.py "
                   "and give the .gguf file")
    try:
        weights = read_safetensors(peft.weights_file)
    except (OSError, ValueError) as exc:
        raise fail(f"adapter_model.safetensors cannot be read: {exc}") from None
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in weights.items():
        layer, module, side = peft.locate(key, TENSORS, base.layers)
        pairs.setdefault((layer, module), {})[side] = tensor
    checked = peft.paired(pairs, base.shapes)
    writer = GGUFWriter(str(out), base.architecture)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 0.0)  # the scale is in B
    for layer, module, a, b in checked:
        b = b * np.float32(peft.scale)
        if CONVERTED_ARCHITECTURES[base.architecture] and module in ("q_proj", "k_proj"):
            b = _pair_rotary_rows(b, base.heads if module == "q_proj" else base.kv_heads)
        stem = f"blk.{layer}.{TENSORS[module]}.weight"
        writer.add_tensor(f"{stem}.lora_a", np.ascontiguousarray(a, dtype=np.float32))
        writer.add_tensor(f"{stem}.lora_b", np.ascontiguousarray(b, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _pair_rotary_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Reorder each head's output rows from Hugging Face's rotary layout (dimension ``j`` pairs
    with ``j + d/2``) to llama.cpp's (``2j`` with ``2j + 1``), as its converter does to the base
    model's query and key weights."""
    out = rows.shape[0]
    return rows.reshape(heads, 2, out // heads // 2, -1).swapaxes(1, 2).reshape(rows.shape)


_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}  # safetensors is little-endian


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file's float tensors as float32 arrays, bfloat16 included (which numpy has
    no type for, so ``safetensors.numpy`` cannot read it)."""
    data = path.read_bytes()
    if len(data) < 8:
        raise ValueError("the file is too short")
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    body = memoryview(data)[8 + size :]
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor `{key}` is {info['dtype']}; F32, F16 and BF16 are read")
        start, end = info["data_offsets"]
        array = np.frombuffer(body[start:end], dtype=dtype).reshape(info["shape"])
        if info["dtype"] == "BF16":  # the top half of a float32
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[key] = array.astype(np.float32)
    return tensors
