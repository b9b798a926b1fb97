"""Load one torch-engine model and report what loading cost, then how long prompts take to start.

Prints the load time, the process's peak RSS (VmHWM) and its RSS once loaded, then the first
token time of ``--prompts`` prompts of ``--prompt-tokens`` random token ids, one at a time,
prefix cache off (each computes its whole prompt). Run it once per tree or option to compare.

RSS counts the pages of the safetensors files the loader has read: they are mapped, and clean
(the kernel drops them under pressure rather than failing), so the peak of the process's own
memory (RssAnon, sampled every 10 ms while loading) is printed beside it: what a machine must
have free.

    .venv/bin/python bench/load.py /tmp/moe --weight-format int4
    .venv/bin/python bench/load.py /tmp/moe --weight-format native --prompts 0
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path


def memory_mib() -> dict[str, int]:
    """VmHWM, VmRSS and RssAnon of this process, MiB."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon"):
                out[key] = int(value.split()[0]) // 1024
    return out


class AnonPeak:
    """The largest RssAnon seen by a thread polling every 10 ms while the block runs."""

    def __enter__(self) -> "AnonPeak":
        import threading

        self.peak, self._done = 0, threading.Event()

        def poll() -> None:
            while not self._done.wait(0.01):
                self.peak = max(self.peak, memory_mib()["RssAnon"])

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, memory_mib()["RssAnon"])


async def first_token_s(engine, prompt: list[int]) -> float:  # type: ignore[no-untyped-def]
    from router.engine import EngineRequest, SamplingParams

    started = time.perf_counter()
    async for _ in engine.generate(EngineRequest("load", prompt, SamplingParams(temperature=0.0), 1, ignore_eos=True)):
        break
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="a Hugging Face folder or a .gguf file")
    p.add_argument("--weight-format", choices=["native", "fp16", "int8", "int4"], default="int4")
    p.add_argument("--kv-cache-gb", type=float, default=0.5)
    p.add_argument("--prompts", type=int, default=4, help="prompts to time after loading (default 4; 0: none)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt (default 512)")
    args = p.parse_args()

    from backends.torch import TorchConfig
    from backends.torch.setup import build_engine

    config = TorchConfig(name="load", backend="torch", path=str(args.model), weight_format=args.weight_format,
                         kv_cache_gb=args.kv_cache_gb, max_model_len=max(2048, args.prompt_tokens + 1),
                         prefix_caching=False)
    started = time.perf_counter()
    with AnonPeak() as anon:
        engine = build_engine(config, args.model)
    loaded = time.perf_counter() - started
    memory = memory_mib()
    print(f"{args.model} ({args.weight_format}): loaded in {loaded:.1f} s; peak RSS {memory['VmHWM']:,} MiB "
          f"(anonymous {anon.peak:,}), RSS after load {memory['VmRSS']:,} MiB (anonymous {memory['RssAnon']:,}; "
          f"{args.kv_cache_gb} GiB KV cache)")
    rng = random.Random(7)
    vocab = engine.tokenizer.vocab_size
    times = []
    for _ in range(args.prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
        times.append(asyncio.run(first_token_s(engine, prompt)))
    if times:
        print(f"first token of a {args.prompt_tokens}-token prompt: " + ", ".join(f"{t:.2f}" for t in times) + " s")
    asyncio.run(engine.stop())


if __name__ == "__main__":
    main()
