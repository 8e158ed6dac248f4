"""The server's runtime: the engine thread and its bridge to asyncio (``bridge``; a request's
side of it in ``events``, a many-prompt request handed over prompt by prompt in
``prompt_window``, the wedge check's CPU witness in ``progress``), a request's heavy work off
the event loop (``offload``), the Prometheus metrics the engine thread records (``metrics``),
the server process under uvicorn (``lifecycle``), a server started as a child process
(``launch``) and the flags of ``hlserve serve`` (``settings``).

Only ``settings`` and ``launch`` are re-exported: both import nothing heavy (no fastapi,
uvicorn or prometheus-client), and neither may this package, which the CLI and the
benchmarks go through to reach them.
"""

from hlserve.server.runtime.launch import ExternalServer, ServerProcess, free_port
from hlserve.server.runtime.settings import ServerSettings, add_server_args, server_settings

__all__ = ["ExternalServer", "ServerProcess", "ServerSettings", "add_server_args", "free_port",
           "server_settings"]
