"""An OpenAI-compatible HTTP API (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``) in front of
the ``ensemble``, over Triton's gRPC streaming API. Run it with ``python -m openai_frontend``."""
