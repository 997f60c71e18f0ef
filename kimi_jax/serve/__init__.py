"""Serving: chat prompt encoding (docs/model.md §11), incremental output parsers, the OpenAI-compatible HTTP API
(``app.py``) and its command line (``python -m kimi_jax.serve``)."""
