"""OpenAI's Responses API (``/v1/responses``) on the chat path: the endpoints (``endpoint``:
a Responses request into the chat request it means, the answer into a ``response``) and
their output items and streamed events (``output_items``)."""

from hlserve.server.responses.endpoint import (
    ResponsesRequest,
    cancel_response,
    create_response,
    delete_response,
    get_response,
)

__all__ = ["ResponsesRequest", "cancel_response", "create_response", "delete_response",
           "get_response"]
