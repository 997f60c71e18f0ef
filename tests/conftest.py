"""Shared pytest setup.

* ``tests/`` goes on ``sys.path`` so tests can ``import np_reference as ref`` and ``import weights_np``.
* JAX runs on CPU unless ``JAX_PLATFORMS`` is already set in the environment (set it, e.g. to ``cuda``, to run
  device tests); this must happen before anything imports jax.
* With JAX on CPU, ``TRITON_INTERPRET=1`` (native Triton kernels in Triton's interpreter), also before any import.
* Compiled programs are cached on disk (``JAX_COMPILATION_CACHE_DIR``), which roughly halves a repeated run.
* Session-scoped fixtures: ``tiny_model`` (``kimi_jax.load_model("tiny")``, built once: ~25 s), ``served`` / ``client``
  (the shared engine + live server over it, and an ``openai`` client for it) and
  ``tiny_np_weights`` (its parameters as the float64 checkpoint-layout dict of ``weights_np.tiny_numpy_weights``).
  Reuse them: every distinct input shape fed to the tiny model costs a fresh XLA compile.
* The README runs the suite on two processes (pytest-xdist, ``-n 2 --dist loadfile``): each worker builds its own
  session fixtures, and each test file runs whole on one worker, so module-scoped compiled fixtures are built once.
* After each test file JAX's caches of compiled programs are dropped (``_release_compiled_programs``), a crashed
  worker ends the run (``pytest_configure``), and a test past pyproject's ``timeout`` fails with every thread's stack.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX on CPU: the native Triton kernels run in Triton's interpreter, which must be on before triton is imported
# (pallas_kernels.triton_call).
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Persistent XLA compilation cache, shared with the subprocess tests through the environment: a second run (or a
# subprocess compiling the same program) loads executables instead of recompiling them.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/kimi_jax/jax_cache_tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

import pytest  # noqa: E402


def pytest_configure(config):
    """Under pytest-xdist, a crashed worker ends the run with that test failed (``--max-worker-restart`` 0 unless
    given): a worker restarted under ``--dist loadfile`` is never handed work, and the run would wait forever."""
    if getattr(config.option, "maxworkerrestart", "absent") is None:
        config.option.maxworkerrestart = 0


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test file, drop JAX's caches of compiled programs.

    Each loaded XLA:CPU executable maps its code into memory, and JAX's caches keep every program a worker ever ran:
    after ~60 files one worker holds ~65,000 mappings, the kernel's default ``vm.max_map_count``, and the next
    executable it loads crashes the process (SIGSEGV inside ``deserialize_executable``). Programs a session fixture
    holds (its engine's compiled runner) stay loaded; a later file that runs a dropped program again loads it from
    the persistent cache.
    """
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_model():
    import kimi_jax

    return kimi_jax.load_model("tiny")


@pytest.fixture(scope="session")
def served(tiny_model):
    """The shared engine + live server over `tiny_model` (`serve_helpers.shared`: built once per session)."""
    import serve_helpers

    return serve_helpers.shared(tiny_model)


@pytest.fixture(scope="session")
def client(served):
    """The official `openai` client pointed at `served`."""
    import openai

    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tiny_np_weights(tiny_model):
    from weights_np import tiny_numpy_weights

    return tiny_numpy_weights(tiny_model)


def _jax_sees_a_cuda_gpu() -> bool:
    import jax

    try:
        return any(d.platform in ("gpu", "cuda") for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests need a CUDA GPU: skipped, with the reason, where JAX sees none (the default here is
    CPU; run them on a GPU host with JAX_PLATFORMS=cuda)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _jax_sees_a_cuda_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run with JAX_PLATFORMS=cuda on a GPU host)")
        for item in gpu_items:
            item.add_marker(skip)
