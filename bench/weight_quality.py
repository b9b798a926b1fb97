"""How far the CPU weight formats move SmolLM2-135M-Instruct from float32, token by token.

For each of the engine-test prompts, float32 greedy decoding writes 64 tokens; then the model
reads prompt + continuation once per format (teacher forcing) and every position's next-token
distribution is compared with float32's: the share of positions whose top token is the same, and
the mean KL divergence KL(float32 || format). Weights only: each projection's weight is replaced by
what the format stores, dequantized: float16; ``int8``, 8 bits with a scale and minimum per 32
inputs; ``int4``, the layers' projections at 4 bits and the LM head at 8; ``int8/64`` and
``int8/128``, larger groups. The packed formats' int16 activations add a rounding of 1/65,534 of
each row's largest value, not modelled here. Runs Hugging Face's own model on the dequantized
GGUF, no server.

Float32 here is the GGUF file dequantized: its projections are Q4_1 blocks and its LM head (tied
to the embeddings) Q8_0, which ``int4`` and ``int8`` reproduce exactly. On a model loaded from
float weights both formats are a real rounding (``int4`` a coarse one); that is not measured
here, for want of a float SmolLM2 on this machine.

    .venv/bin/python bench/weight_quality.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from backends.torch.quantize import pack_weight, unpack_weight  # noqa: E402
from test_torch_engine import PROMPTS  # noqa: E402
from torch_models import smollm2_folder  # noqa: E402

CONTINUATION = 64


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_folder()
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    original = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    with torch.inference_mode():
        seqs = []
        for prompt in PROMPTS:
            ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
            out = model.generate(ids, max_new_tokens=CONTINUATION, do_sample=False, eos_token_id=None, pad_token_id=0)
            seqs.append(out)
        reference = [model(s).logits[0].log_softmax(-1) for s in seqs]

    def store(name: str, weight: torch.Tensor, fmt: str) -> torch.Tensor:
        if fmt == "fp16":
            return weight.half().float()
        kind, _, group = fmt.partition("/")
        bits = 4 if kind == "int4" and name != "lm_head" else 8
        return unpack_weight(pack_weight(weight, bits, int(group or 32)), bits, *weight.shape)

    print(f"{len(seqs)} prompts, {CONTINUATION} greedy float32 tokens each, teacher-forced")
    print(f"{'format':<10} {'top-1 same':>10} {'mean KL':>9}")
    for fmt in ("fp16", "int8", "int4", "int8/64", "int8/128"):
        with torch.inference_mode():
            for name, m in model.named_modules():
                if name in original:
                    m.weight = torch.nn.Parameter(store(name, original[name], fmt), requires_grad=False)
            same = total = 0
            kl = 0.0
            for s, ref in zip(seqs, reference):
                got = model(s).logits[0].log_softmax(-1)
                same += int((got.argmax(-1) == ref.argmax(-1)).sum())
                total += ref.shape[0]
                kl += float(F.kl_div(got, ref, log_target=True, reduction="sum"))
        print(f"{fmt:<10} {same / total:>10.4f} {kl / total:>9.5f}")


if __name__ == "__main__":
    main()
