"""End to end: OpenAI's Predicted Outputs (``prediction``) over HTTP with the openai SDK. The
torch engine drafts from the prediction: the same answer as without one, in fewer steps, with
the prediction's kept and refused tokens in usage. llama.cpp cannot use one: a 400 naming it."""

from __future__ import annotations

import httpx
import openai
import pytest

from sse_util import sdk_stream

CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"
MESSAGES = [{"role": "user", "content": f"Repeat this code exactly:\n\n{CODE}"}]


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def chat(client, **fields):
    return client.chat.completions.create(model="smollm2-torch", messages=MESSAGES, temperature=0, max_tokens=48, **fields)


def test_same_answer_with_a_prediction_and_its_tokens_in_usage(client):
    plain = chat(client)
    assert plain.usage.completion_tokens_details is None  # no prediction, no details
    answer = plain.choices[0].message.content
    assert "width * height" in answer
    guess = answer.replace("height", "depth", 1)  # most of it right
    for prediction in (answer, guess, [{"type": "text", "text": guess[:20]}, {"type": "text", "text": guess[20:]}]):
        reply = chat(client, prediction={"type": "content", "content": prediction})
        assert reply.choices[0].message.content == answer
        details = reply.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= 10
        assert reply.usage.completion_tokens == plain.usage.completion_tokens
    assert details.rejected_prediction_tokens >= 1  # "depth" was drafted and refused


def test_a_stream_with_a_prediction(client):
    answer = chat(client).choices[0].message.content
    stream = chat(client, prediction={"type": "content", "content": answer}, stream=True,
                  stream_options={"include_usage": True})
    text, usage, chunks = sdk_stream(stream)
    assert text == answer
    assert usage.completion_tokens_details.accepted_prediction_tokens >= 10
    assert chunks < usage.completion_tokens  # the prediction's tokens came several a step


def test_llama_cpp_cannot_use_a_prediction(base_url):
    body = {"model": "smollm2", "messages": MESSAGES, "prediction": {"type": "content", "content": CODE}}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "Model `smollm2` (backend `llamacpp`) cannot honour `prediction`.",
                                 "type": "invalid_request_error", "param": "prediction", "code": "unsupported_parameter"}


@pytest.mark.parametrize(
    "path, prediction, needle",
    [
        ("/v1/chat/completions", {"type": "text", "content": "x"}, "prediction"),
        ("/v1/chat/completions", {"type": "content"}, "prediction"),
        ("/v1/chat/completions", {"type": "content", "content": []}, "prediction"),
        ("/v1/chat/completions", {"type": "content", "content": "x", "extra": 1}, "prediction"),
        ("/v1/completions", {"type": "content", "content": "x"}, "Unrecognized request argument supplied: prediction"),
    ],
)
def test_bad_predictions_are_400s_naming_the_field(base_url, path, prediction, needle):
    body = {"model": "smollm2-torch", "prediction": prediction}
    body |= {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "Hi"}
    r = httpx.post(f"{base_url}{path}", json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert needle in err["message"] or err["param"].startswith(needle), err


def test_prediction_tokens_counted_when_a_stop_string_ends_the_answer(client):
    """A stop string ends the request before the engine's last step: the counts come with every
    step, and only the tokens the answer holds count as accepted."""
    answer = chat(client).choices[0].message.content
    reply = chat(client, prediction={"type": "content", "content": answer}, stop=["perimeter"])
    assert reply.choices[0].message.content == answer[: answer.index("perimeter")]
    details = reply.usage.completion_tokens_details
    assert 5 <= details.accepted_prediction_tokens <= reply.usage.completion_tokens
