"""The engine's settings: ``EngineConfig`` (every knob of ``Engine``, overridable by keyword) and the defaults that
the server, the exporter and the benchmarks derive from it (``default_decode_buckets``,
``DEFAULT_TOKEN_SPLIT_MIN_TOKENS``).  Plain data: validation happens in ``Engine.__init__``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


SPECULATIVE_METHODS = ("ngram", "draft")  # who drafts: prompt lookup (`ngram.py`), a draft model (`draft_model.py`)

# The default threshold of the token-split prefill (`EngineConfig.token_split_min_tokens`): chunks of 1024 tokens
# and more (the accelerator default chunk sizes are 1024, 256, 64, 1) split over the context axis, the shorter ones
# run whole on every device of it.  At 1024 tokens each of 8 devices gets 128, two blocks of the KDA chunked op (it
# pads every call to whole 64-token blocks); the split's fixed costs -- the all-gather of every KDA layer's
# [H, dk, dk + dv] state transition, the N-step combine, the gathers of the chunk's latent rows and queries --
# weigh on a few tokens per device and are small beside a long chunk's work, which it divides N ways.  A reasoned
# choice, not a measured crossover.
DEFAULT_TOKEN_SPLIT_MIN_TOKENS = 1024


@dataclass
class EngineConfig:
    max_num_seqs: int = 32
    max_model_len: int = 2048
    prefill_chunk_sizes: tuple[int, ...] = (64, 1)  # see the note on chunk sizes in engine.py
    prefill_token_budget: int = 256
    kv_dtype: Optional[str] = None  # paged latent format: None / "auto" (the model's dtype), fp32, bf16, fp8, nvfp4
    index_dtype: Optional[str] = None  # index keys: None (fp32 / bf16 beside those latents, else fp8), fp8, mxfp4
    num_blocks: Optional[int] = None  # pages per MLA pool incl. the null page; None: every slot at max_model_len
    # prefix caching (prefix_cache.py): pages shared between sequences whose ids start alike, and KDA checkpoints to
    # resume from; on by default
    prefix_caching: bool = True
    # KDA checkpoints the prefix cache holds at most (each is one sequence's KDA state); None: max_num_seqs, at least 8
    prefix_checkpoints: Optional[int] = None
    # a checkpoint every this many pages of a prefill; None: by memory cost (`prefix_cache.checkpoint_interval`)
    prefix_checkpoint_blocks: Optional[int] = None
    # decode context parallelism: the paged cache's tokens split over this many ranks (the mesh's tensor or context
    # axis of that size); 1: the pools whole on every device
    dcp: int = 1
    # with dcp > 1 over a context axis: prefill chunk sizes of at least this many tokens run split by tokens over it
    # (`runner.py`, ``prefill_split``); 0: never. See DEFAULT_TOKEN_SPLIT_MIN_TOKENS for the default
    token_split_min_tokens: int = DEFAULT_TOKEN_SPLIT_MIN_TOKENS
    parallel_compile: bool = False  # serial measured faster on a 2-core CPU (XLA already uses threads)
    images: Optional[bool] = None  # compile the image prefill programs; None: when the model has a vision tower
    # compile the vision tower for every image patch bucket at start, in a background thread (serving starts at
    # once; an image request waits only for its own bucket, smallest first): what a server on an accelerator wants
    vision_warmup: bool = False
    # the vision tower runs the queue head's images together with those of the requests waiting behind it whose
    # tower programs are compiled, up to this many images in one `Model.encode_images` call (their runs overlap;
    # 1: each request's images alone)
    vision_batch_images: int = 16
    # speculative decoding (docs/model.md §12): drafts per verify step (0: off), who drafts them ("ngram": prompt
    # lookup; "draft": a draft model, `Engine(draft_model=...)`) and the prompt-lookup n-gram sizes
    speculative_tokens: int = 0
    speculative_method: str = "ngram"
    # how a draft model drafts (docs/model.md §12's draft_sample_method, `draft_model.DRAFT_SAMPLE_METHODS`): "greedy"
    # (its argmax) or "probabilistic" (sampled rows draw their drafts from the draft's q, verified with min(1, p/q))
    draft_sample_method: str = "greedy"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # verify only when drafts are expected to pay for the wider step (spec_policy.py); False: whenever a row drafts
    speculative_adaptive: bool = True
    speculative_cost: Optional[float] = None  # verify step time / one-token step time; None: measured as it runs
    # bit-exact batch invariance under speculative decoding: every step is a verify step and every row drafts what
    # its own proposer gives (no adaptive policy). Without it a row's token comes from the verify program when some
    # other row drafts and from the one-token step otherwise -- equal up to float rounding, not bit for bit
    speculative_batch_invariant: bool = False
    # row counts below max_num_seqs with decode (and verify) programs of their own: a step runs the smallest bucket
    # that holds the running sequences, over just their slots (`ModelRunner.bucket_for`); () = always all slots
    decode_buckets: tuple[int, ...] = ()
    # overlapped decode steps (vLLM's async scheduling, overlap.py): in plain decoding the next step is dispatched
    # before this one's tokens are read, so the host work between steps runs while the device computes. None: on
    # on an accelerator (one process or several), off on CPU (whose "device" is the host's own cores)
    async_scheduling: Optional[bool] = None
    # a second build of every decode / verify program with the plain sampler (no top-k / top-p / min-p filter, no top
    # log-probs: no lax.cond), run when no running sequence uses either (sampler.py). On a GPU each lax.cond runs on
    # the host (XLA's command buffers leave conditionals out by default): it copies its predicate back and waits for
    # the device, every step. None: on for a GPU, off elsewhere (a TPU branches on the device; a CPU runs in order)
    plain_sampling: Optional[bool] = None


def default_decode_buckets(max_num_seqs: int, data_ways: int = 1) -> tuple[int, ...]:
    """Powers of two below ``max_num_seqs`` (vLLM's graph sizes 1, 2, 4, 8, …), multiples of the mesh's data
    axis so that every bucket splits over it."""
    buckets, b = [], max(1, int(data_ways))
    while b < max_num_seqs:
        buckets.append(b)
        b *= 2
    return tuple(buckets)

