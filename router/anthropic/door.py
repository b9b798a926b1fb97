"""Anthropic's door into the chat pipeline: ``POST /v1/messages`` decoded and translated into a
chat request, the chat answer translated back (:mod:`router.anthropic.translate`,
:mod:`router.anthropic.stream`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator

import msgspec

from ..params import GenerationParams
from ..requests import chat_params, decode_body
from .protocol import CountTokensRequest, MessagesRequest
from .stream import MessageEvents
from .translate import chat_request, message

if TYPE_CHECKING:
    from ..state import RouterState

_messages = msgspec.json.Decoder(MessagesRequest)
_count_tokens = msgspec.json.Decoder(CountTokensRequest)
_encode = msgspec.json.Encoder().encode


class MessagesDoor:
    """One Messages request's way through the chat pipeline."""

    def __init__(self, state: "RouterState", allowed: frozenset[str] | None) -> None:
        self._state = state
        self._allowed = allowed

    def decode(self, body: bytes, counting: bool = False) -> tuple[Any, GenerationParams]:
        """The chat request and parameters ``body`` means (``counting``: a ``count_tokens`` body)."""
        req = decode_body(_count_tokens if counting else _messages, body)
        backend = self._state.model(req.model, self._allowed)  # an unknown model: 404 first
        types = self._state.types
        chat = chat_request(req, types.chat, set(types.fields), backend.config.reasoning_parser is not None,
                            stream_usage=backend.local)
        params = chat_params(chat)
        params.fit_max_tokens = True
        return chat, params

    @staticmethod
    def reply(body: bytes) -> bytes:
        return _encode(message(body))

    @staticmethod
    def stream(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        return MessageEvents(events)
