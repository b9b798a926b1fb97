"""``prediction``: OpenAI's Predicted Outputs on chat completions.

``{"type": "content", "content": "..."}`` (or a list of text parts) is text the answer is
expected to mostly repeat, such as a file the user asks to edit. The answer is the one the
model would give without it; an engine that verifies drafted tokens (the torch engine's
speculative decoding) drafts from it, so the parts that match come several tokens a step.
Usage then carries ``completion_tokens_details`` with the prediction's tokens the model kept
(``accepted_prediction_tokens``) and refused (``rejected_prediction_tokens``). A model whose
backend cannot use a prediction answers 400, as OpenAI does for models without the feature.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from router.hookspecs import RequestField, hookimpl


class PredictionText(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text"]
    text: str


class Prediction(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["content"]
    content: Union[str, Annotated[list[PredictionText], Meta(min_length=1)]]


@hookimpl
def request_fields() -> list[RequestField]:
    return [
        RequestField("prediction", Prediction | None, None, ("chat",),
                     description="Predicted Outputs: text the answer is expected to mostly repeat "
                                 "(speeds it up where it does; the answer is unchanged)."),
    ]


@hookimpl
def prepare_request(request: Any, model: Any, params: Any, endpoint: str) -> None:
    prediction = getattr(request, "prediction", None)
    if prediction is None:
        return
    content = prediction.content
    params.prediction = content if isinstance(content, str) else "".join(part.text for part in content)
    params.require("prediction", "prediction")
