"""`hlserve serve`: the OpenAI-compatible HTTP server around one engine thread.

Its parts stack, top to bottom; a module imports from its own folder or from a line below
its own, and parts on one line do not import each other (``SERVER_LAYERS`` in
tests/test_layout.py):

- ``app.py``: the app factory (``create_app``), the engine it serves, and ``serve``.
- ``routes.py``: one handler per endpoint, and ``add_routes``, which lists them all.
- ``responses/``: the Responses API (``/v1/responses``), run on the chat path below it.
- ``openai_api/``: chat and text completions, the path every generation request takes: the
  server's state, API keys, intake, prompts, generation, whole bodies and streams, error
  replies, sampling defaults and the stored responses that the state holds.
- ``tools/``: tool calls, reasoning and output constraints, parsed or checked per request.
- ``protocol.py`` · ``runtime/``: the OpenAI wire format (request models, ``ApiError``) ·
  the engine thread and its bridge to asyncio, the server process, its metrics and flags.

Nothing heavy is imported here or by ``runtime/``'s own ``__init__``: the CLI builds its
parser from ``runtime/settings.py`` without the ``server`` extra.
"""
