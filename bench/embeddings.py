"""Embeddings throughput: the router's ``/v1/embeddings`` (all-MiniLM-L6-v2 in its worker)
against sentence-transformers' ``encode`` on the same folder, side by side in one run.

For each batch size (1, 32, 256 short texts a request) the router is driven by ``clients``
concurrent clients for ``--seconds`` (as a service is: several callers at once, ``base64`` as the
openai SDK asks), and sentence-transformers encodes the same batches one after another in this
process (as a library is used), in turn, ``--rounds`` times; texts/s and the ratio per round.

    .venv/bin/python bench/embeddings.py [--seconds 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from router_server import RouterServer  # noqa: E402

MINILM = "pkg:all_minilm_l6_v2/model.zip"
LEVELS = [(1, 16), (32, 4), (256, 1)]
"""(texts a request, concurrent clients)."""
WORDS = ("the quick brown fox jumps over a lazy dog while rain falls on quiet city streets "
         "and people read books about rivers mountains music and old trains").split()


def texts(n: int, rng: random.Random) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(n)]


async def drive_router(url: str, batch: int, clients: int, seconds: float) -> float:
    rng = random.Random(batch)
    done = 0
    deadline = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            r = await http.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": texts(batch, rng),
                                                              "encoding_format": "base64"})
            r.raise_for_status()
            done += batch

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return done / (time.monotonic() - start)


def drive_library(model, batch: int, seconds: float) -> float:
    rng = random.Random(batch)
    done = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        model.encode(texts(batch, rng))
        done += batch
    return done / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from backends.torch.embedder import model_folder
    from router.config import resolve_path

    library = SentenceTransformer(str(model_folder(resolve_path(MINILM))), device="cpu")
    config = f'[[models]]\nname = "minilm"\nbackend = "torch"\ntask = "embed"\npath = "{MINILM}"\n'
    with tempfile.TemporaryDirectory() as tmp:
        server = RouterServer("embeddings", config, Path(tmp))
        try:
            asyncio.run(drive_router(server.url, 32, 2, 2))  # warm: first passes, allocator
            drive_library(library, 32, 2)
            rows = []
            for batch, clients in LEVELS:
                ratios, ours, theirs = [], [], []
                for _ in range(args.rounds):
                    lib = drive_library(library, batch, args.seconds)
                    rt = asyncio.run(drive_router(server.url, batch, clients, args.seconds))
                    ours.append(rt)
                    theirs.append(lib)
                    ratios.append(rt / lib)
                rows.append((batch, clients, statistics.median(ours), statistics.median(theirs),
                             statistics.median(ratios), ratios))
        finally:
            server.stop()
    print("| texts a request | router clients | router texts/s | sentence-transformers texts/s | ratio (median) | rounds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for batch, clients, rt, lib, ratio, ratios in rows:
        print(f"| {batch} | {clients} | {rt:.0f} | {lib:.0f} | {ratio:.2f} | {', '.join(f'{r:.2f}' for r in ratios)} |")


if __name__ == "__main__":
    main()
