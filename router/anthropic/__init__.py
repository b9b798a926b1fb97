"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on every
model: its requests translated into the chat requests they mean, run through the chat pipeline,
the answers translated back, errors in Anthropic's envelope on its paths."""
