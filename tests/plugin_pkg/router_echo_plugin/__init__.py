"""A third-party router plugin: the ``echo`` backend and the ``echo_times`` request field.

The echo engine answers with the prompt's own text (after its chat template), ``echo_times``
times over, one byte-token per step. It goes through the router's shared serving pipeline like
any local engine, so streaming, stop strings and usage all apply.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, AsyncIterator, Sequence

from msgspec import Meta

from router.backend import LocalBackend
from router.config import ModelConfig
from router.engine import EngineRequest, EngineStep
from router.hookspecs import RequestField, hookimpl

EOS = 256


class ByteTokenizer:
    vocab_size = 257
    bos_token = None
    eos_token = "</s>"
    eos_token_ids = frozenset({EOS})
    special_tokens = frozenset({"</s>"})

    def encode(self, text: str, *, add_special_tokens: bool, parse_special: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(t for t in ids if t < 256).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return b"</s>" if token_id == EOS else bytes([token_id])

    def token_str(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", "replace")


class EchoEngine:
    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    capabilities = frozenset({"echo_times"})

    def __init__(self, max_model_len: int) -> None:
        self.tokenizer = ByteTokenizer()
        self.max_model_len = max_model_len
        self.running = 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"running": self.running, "waiting": 0}

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        out = list(request.prompt_ids) * request.extras.get("echo_times", 1) + [EOS]
        self.running += 1
        try:
            for n, token in enumerate(out[: request.max_tokens], start=1):
                await asyncio.sleep(0)
                finish = "stop" if token == EOS else ("length" if n == request.max_tokens else None)
                yield EngineStep([token], finish_reason=finish, cached_tokens=0 if n == 1 else None)
                if finish:
                    return
        finally:
            self.running -= 1


class EchoConfig(ModelConfig, kw_only=True, forbid_unknown_fields=True):
    context: Annotated[int, Meta(ge=16)] = 4096


class EchoBackend(LocalBackend):
    Config = EchoConfig

    def create_engine(self) -> EchoEngine:
        return EchoEngine(self.config.context)


@hookimpl
def register_backends(register) -> None:
    register("echo", EchoBackend)


@hookimpl
def request_fields() -> list[RequestField]:
    return [RequestField("echo_times", Annotated[int, Meta(ge=1, le=10)], 1, ("chat", "completions"),
                         "How many times the echo backend repeats the prompt.")]


@hookimpl
def prepare_request(request: Any, model: Any, params: Any, endpoint: str) -> None:
    if request.echo_times != 1:
        params.extras["echo_times"] = request.echo_times
        params.require("echo_times", "echo_times")
