"""`hlserve serve`: the OpenAI-compatible HTTP server around one engine thread."""
