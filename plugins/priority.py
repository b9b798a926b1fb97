"""``priority``: lower runs earlier when a model's work is queued; ties go by arrival."""

from __future__ import annotations

from typing import Any

from router.hookspecs import RequestField, hookimpl


@hookimpl
def request_fields() -> list[RequestField]:
    return [
        RequestField("priority", int, 0,
                     description="Scheduling priority: lower runs earlier (default 0)."),
    ]


@hookimpl
def prepare_request(request: Any, model: Any, params: Any, endpoint: str) -> None:
    if request.priority:
        params.priority = request.priority
        params.require("priority", "priority")
