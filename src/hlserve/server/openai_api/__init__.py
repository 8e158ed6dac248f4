"""Chat and text completions, the path every generation request takes (the Responses API's
too): the server's state (``state``), API keys and their middleware (``auth``), reading and
checking a request (``intake``, ``limits``, ``generation_defaults``), prompts into token ids
(``prompts``), the engine and back (``generation``), whole bodies (``completion_bodies``) or
server-sent events (``streaming``) with logprobs in the wire shapes (``logprobs``), errors as
the client sees them (``error_replies``), and the stored responses of ``/v1/responses``
(``response_store``), which the state holds."""

from hlserve.server.openai_api.auth import AuthMiddleware, KeyTable
from hlserve.server.openai_api.error_replies import add_exception_handlers
from hlserve.server.openai_api.state import ServerState, state_of

__all__ = ["AuthMiddleware", "KeyTable", "ServerState", "add_exception_handlers", "state_of"]
