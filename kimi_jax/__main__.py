"""`python -m kimi_jax` runs the server (same as `python -m kimi_jax.serve`)."""

from .serve.__main__ import main

raise SystemExit(main())
