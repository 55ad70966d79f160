"""The OpenAPI document of the agent APIs (Responses, Anthropic Messages): the same typed
request bodies the gateway decodes, built without a running gateway. The routes are not yet in
the gateway's /schema (whose tests count its operations); `python -m keepwarm.api.agent_schema`
prints this document."""

from __future__ import annotations

import json
from typing import Any

from litestar import Litestar
from litestar.openapi import OpenAPIConfig
from litestar.serialization import encode_json

from keepwarm.api import messages_api, responses_api
from keepwarm.engine.serving import wire


def openapi_document() -> dict[str, Any]:
    """The document of POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/messages
    and POST /v1/messages/count_tokens."""
    gw: Any = None  # the handlers reach the gateway only when called
    app = Litestar(
        route_handlers=[
            *responses_api.routes(gw, include_in_schema=True),
            *messages_api.routes(gw, include_in_schema=True),
        ],
        openapi_config=OpenAPIConfig(title="keepwarm gateway: agent APIs", version="0.1.0", path="/schema"),
        plugins=[wire.ClosedStructSchema()],
    )
    doc: dict[str, Any] = json.loads(encode_json(app.openapi_schema.to_schema()))
    return doc


if __name__ == "__main__":
    print(json.dumps(openapi_document(), indent=2))
