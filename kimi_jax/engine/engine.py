"""The serving engine: a request queue, continuous batching over a fixed set of cache slots, one background thread.

``Engine`` is the one public class; its parts live by job: ``scheduler.py`` (admission, chunked prefill, the prefix
cache, pages and preemption), ``speculation.py`` (drafting and the verify step's inputs), ``output.py`` (emission,
stops, finishing requests), ``overlap.py`` (dispatching the next decode step before this one's tokens are read),
each a mixin whose module says which engine attributes it reads and writes.  This file holds construction, the
lifecycle, the public API, the loop and the decode step; ``config.py`` the ``EngineConfig``, ``sequences.py`` the
records of requests, sequences and prefills.

Life of a request (``submit`` -> ``RequestStream``):

1. **Queue.**  ``submit`` validates and puts the request on an inbox; the engine thread moves it to ``waiting``
   (first come, first served; a request of ``n`` sequences waits until ``n`` slots are free together, and until
   the page pool has room for its prefill, ``n`` × its pages plus one page of headroom per running sequence).
2. **Prefill.**  One request at a time.  Its prompt minus the last token is run into the first sequence's pages
   of the paged MLA pools (allocated up front from the engine's ``BlockAllocator``) and a fresh batch-1 KDA state, in
   chunks whose sizes come from the fixed set ``prefill_chunk_sizes`` (largest first) -- exact tokens, never
   padding, since padding would enter the KDA recurrent state.  While sequences are decoding, each engine iteration
   spends at most ``prefill_token_budget`` prompt tokens on prefill before the next decode step, so a long prompt
   does not stall the others.  The leftover (< smallest chunk) and the prompt's last token are fed through the
   decode steps ("tail" tokens; their sampled outputs are ignored), so prefill needs no program per leftover
   length.  The finished batch-1 cache is inserted into the request's slots (all ``n`` share that one prefill).
   With ``dcp`` > 1 over a context axis, text chunks of at least ``token_split_min_tokens`` run split by tokens
   over it (``runner.py``, ``prefill_split``: the same result, the KDA state passed on exactly) wherever they start:
   a later chunk, a recompute after preemption or the rest after a prefix-cache hit continues from the state and
   pages before it.  ``stats()["token_split_prefill_tokens"]`` counts the prompt tokens that went that way.
3. **Decode.**  Every iteration runs ONE compiled step of fixed shape ``[max_num_seqs]`` for all slots: running
   rows feed their next token (a prompt tail token or the last sampled token), free rows a dummy token that is
   ignored.  Sampling (``sampler.py``) is fused into the step with per-row parameters.  In plain decoding the next
   step is dispatched before this one's tokens are read, its input tokens taken on the device (``overlap.py``,
   ``async_scheduling``).  Steady-state serving never compiles anything (``compile_watch`` counts it;
   ``stats()["compilations"]``).
4. **Stop.**  A sequence ends on an end-of-turn / ``stop_token_ids`` token (unless ``ignore_eos``), a stop string
   (``detok.OutputText``), its guide finishing (``guide.py``), ``max_tokens``, or the cache end (``max_model_len``);
   or on ``abort`` / client disconnect.  Its slot and pages are freed at once.  Text and control tokens go out as
   ``SeqEvent`` pieces.

Pages (``runner.py``, ``kimi_jax.paged_cache``): every MLA layer keeps one pool of 64-token pages (``kv_dtype`` fp32 /
bf16 / fp8 / nvfp4; default pool ``1 + max_num_seqs · ceil(max_model_len / 64)`` pages, or ``num_blocks``).  A
sequence holds ``ceil(tokens / 64)`` pages, the first of them possibly shared with the prefix cache (reference
counted: a full page is never written again); before each decode step every running sequence gets the page its next
token lands in.  **Preemption by recompute:** when the pool is empty, pages only the prefix cache holds are evicted
first (least recently used), then the youngest running sequence (latest admitted; a prefill in progress counts as
youngest) is evicted -- its pages and slot freed -- and re-queued at the front; when it is admitted again its
prompt + generated tokens are prefilled again (exactly as a new prompt would be) and it continues where it stopped,
with its penalty counts restored, so greedy output is unchanged.  A lone sequence always fits (the pool holds at
least one ``max_model_len`` sequence), so this cannot livelock.

Choosing ``prefill_chunk_sizes``: the KDA chunked op works in blocks of ``kda.chunk_size`` (64) and pads every call
to whole blocks, so a 16-token call costs as much as a 64-token one; T = 1 takes the cheap recurrent path.  Useful
sets are therefore multiples of 64 plus 1 (default ``(64, 1)``; on accelerators ``(1024, 256, 64, 1)``).  Without 1
in the set, the leftover tokens ride the decode steps instead (no extra program, one token per step).

Images (``images.py``): ``submit(..., images=[uint8 RGB [H, W, 3], ...])`` with the prompt's ``<|media_pad|>``
tokens already expanded to each image's token count.  Each image runs padded to a patch-count bucket
(``modules.vision_buckets``); a bucket's tower program is compiled in a background thread the first time a request
needs it, and that request waits at the head of the queue until it is ready while running sequences keep
decoding.  The vision tower runs once, on the engine thread, when the request is first admitted; the features stay
with the request (a recompute after preemption reuses them).  Prefill
chunks that hold image tokens run the runner's ``prefill_img`` program (features + mask spliced into the embeddings;
a chunk may start or end inside an image), the others the text program.  The prefix cache keys image tokens by the
image's pixel digest, so equal token ids with different images never share pages or a checkpoint.

Seams for what comes next:

* **Prefix caching** (on by default, ``prefix_cache.py``) -- ``_admit`` (``scheduler.py``) asks
  ``self.prefix_cache.lookup`` for the deepest KDA checkpoint on the prompt's ids, shares the pages before it and
  prefills the rest; checkpoints are left during prefill, at its end, and when a sequence finishes or is preempted
  (``_checkpoint_prefill`` / ``_checkpoint_sequence``).
* **Speculative decoding** (``speculative_tokens = k > 0``, docs/model.md §12, ``spec_decode.py``) -- ``_decode``
  is the only place that advances running sequences.  When the proposer (``ngram.NgramProposer``, prompt lookup, or
  ``draft_model.DraftModelProposer``, a draft model's greedy or sampled continuation) drafts
  for some row, the iteration runs the runner's ``verify`` program instead of ``step``: ``[B, k+1]`` tokens, the
  acceptance rule and the cache roll-back in one program; each row then emits ``accepted + 1`` tokens through
  ``_emit`` (``output.py``; stop logic, streams and metrics unchanged).  A guided row's drafts come from walking a
  copy of its guide (``speculation.py``: forced tokens outright, lookup tokens where allowed), with the guide's
  constraint per position.  Drafts never preempt anything: a row drafts only as far as the pages it holds and the
  free ones reach.
  ``spec_policy.SpecPolicy`` decides per step whether the drafts are expected to pay for the wider step (each
  sequence's acceptance so far, the measured verify / step time ratio; a draft model's time counts in the
  step it drafts for).
* **Multi-device** -- ``runner.py`` owns every device program; sharded parameters and caches (``--mesh``) only
  change how ``ModelRunner`` lowers them.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import uuid
from collections import deque
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from sharding.mesh import mesh_platform

# not `from . import compile_watch`: the package's __init__ imports this module
import kimi_jax.engine.compile_watch as compile_watch

from ..cache import CacheLayout, allocate
from ..modules.vision_buckets import patch_buckets, programs_for
from ..paged_cache import BlockAllocator, BlockTable
from .config import (  # noqa: F401 -- re-exported: `from kimi_jax.engine.engine import EngineConfig, ...`
    DEFAULT_TOKEN_SPLIT_MIN_TOKENS, SPECULATIVE_METHODS, EngineConfig, default_decode_buckets)
from .draft_model import DRAFT_SAMPLE_METHODS, DraftModelProposer
from .guide import Guide, MAX_ALLOWED_IDS, class_table_rows, vocab_class_masks
from .images import PromptImages
from .multihost import Mirror, mirror_runner
from .ngram import NgramProposer
from .output import OutputMixin
from .overlap import OverlapMixin
from .prefix_cache import MIN_DEFAULT_CHECKPOINTS, PrefixCache, checkpoint_interval
from .request import EngineDeadError, EngineUnavailableError, RequestFailedError, RequestStream, SequenceOutput
from .runner import ModelRunner, resolve_kv_dtype
from .sampler import Controls, RowParams, empty_controls
from .sampling_params import ParamError, SamplingParams
from .scheduler import SchedulerMixin
from .sequences import _Prefill, _Request, _Seq
from .spec_policy import SpecPolicy
from .speculation import SpeculationMixin

log = logging.getLogger("kimi_jax.engine")


class Engine(SchedulerMixin, SpeculationMixin, OutputMixin, OverlapMixin):
    """The serving engine (the module docstring); the jobs of its bases live in scheduler.py, speculation.py,
    output.py and overlap.py, its state is created here."""

    def __init__(self, model, tokenizer, config: Optional[EngineConfig] = None, *,
                 runner: Optional[ModelRunner] = None, draft_model=None, mirror: Optional[Mirror] = None,
                 **overrides):
        """``runner``: reuse the compiled programs of another engine with the same model and shapes (a restart
        after a failure, a second front end) instead of compiling again. ``draft_model``: a smaller ``Model`` over
        the same vocabulary that drafts for speculative decoding (``speculative_method="draft"``). ``mirror``: a
        multi-process server's `multihost.Mirror` (built alike on every process; process 0 runs the engine, the
        others replay its device calls with `Mirror.follow`); a draft model is single-process only. The vision tower
        runs on process 0 alone, on its first local device (where its parameters live): its features travel to the
        other processes as host inputs of the image prefill chunks."""
        cfg = config or EngineConfig()
        if overrides:
            cfg = EngineConfig(**{**cfg.__dict__, **overrides})
        self.config = cfg
        self.model = model
        self.tokenizer = tokenizer
        mcfg = model.config
        self.vocab_size = mcfg.vocab_size
        if cfg.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {cfg.max_num_seqs}")
        if not 2 <= cfg.max_model_len <= mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {mcfg.max_position_embeddings}] "
                             f"(the model's max_position_embeddings), got {cfg.max_model_len}")
        if tokenizer.vocab_size > self.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {self.vocab_size}")
        self.B = cfg.max_num_seqs
        self.max_model_len = cfg.max_model_len
        self.stop_ids = frozenset(tokenizer.stop_ids)
        stop_mask = np.zeros(self.vocab_size, bool)
        stop_mask[list(self.stop_ids)] = True
        self.class_masks = vocab_class_masks(tokenizer, self.vocab_size)
        # dynamic rows of the class table: one per slot and verify position, holding a step's bitmask constraint
        # (`Constraint.bits`, a grammar's allowed set) for that row; uploaded only in steps that use them
        self._dyn_base, self._dyn_per_slot = len(self.class_masks), max(0, cfg.speculative_tokens) + 1
        dyn_rows = class_table_rows(self.B, cfg.speculative_tokens) - len(self.class_masks)
        self._dyn_bits = np.zeros((dyn_rows, -(-self.vocab_size // 32)), np.int32)
        self._dyn_dirty = False
        class_table = np.concatenate([self.class_masks, np.zeros((len(self._dyn_bits), self.vocab_size), bool)])
        kv_dtype = resolve_kv_dtype(cfg.kv_dtype, model.dtype)
        self.mirror = mirror or Mirror()
        if self.mirror.multiprocess and draft_model is not None:
            raise ValueError("a draft model (--speculative-model) is not served across processes: it runs on process "
                             "0's first device; use prompt lookup drafts (--speculative-tokens alone)")
        platform = mesh_platform(getattr(model, "mesh", None))
        self.async_scheduling = cfg.async_scheduling if cfg.async_scheduling is not None else platform != "cpu"
        images = cfg.images if cfg.images is not None else getattr(model, "vision", None) is not None
        plain_sampling = cfg.plain_sampling if cfg.plain_sampling is not None else platform == "gpu"
        if cfg.dcp < 1:
            raise ValueError(f"dcp must be >= 1, got {cfg.dcp}")
        if cfg.token_split_min_tokens < 0:
            raise ValueError(f"token_split_min_tokens must be >= 0 (0: no token-split prefill), got "
                             f"{cfg.token_split_min_tokens}")
        # default pool: every slot at max_model_len (the planner's formula); cached prefixes live in the pages the
        # running sequences leave free and are evicted as they need them
        num_blocks = cfg.num_blocks
        if num_blocks is None:
            num_blocks = allocate(CacheLayout(model.config), max_num_seqs=self.B, max_model_len=self.max_model_len,
                                  dcp=cfg.dcp).num_blocks
        if cfg.prefix_checkpoints is not None and cfg.prefix_checkpoints < 1:
            raise ValueError(f"prefix_checkpoints must be >= 1 (turn prefix caching off with prefix_caching=False), "
                             f"got {cfg.prefix_checkpoints}")
        if cfg.prefix_checkpoint_blocks is not None and cfg.prefix_checkpoint_blocks < 1:
            raise ValueError(f"prefix_checkpoint_blocks must be >= 1, got {cfg.prefix_checkpoint_blocks}")
        if cfg.vision_batch_images < 1:
            raise ValueError(f"vision_batch_images must be >= 1, got {cfg.vision_batch_images}")
        self.proposer = None
        if cfg.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, got {cfg.speculative_tokens}")
        if cfg.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {cfg.speculative_method!r}; this engine has: "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if (draft_model is not None) != (cfg.speculative_method == "draft"):
            raise ValueError("speculative_method='draft' and a draft_model go together: pass both or neither")
        if draft_model is not None and not cfg.speculative_tokens:
            raise ValueError("a draft model needs speculative_tokens >= 1 (the drafts per verify step)")
        if cfg.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"unknown draft sample method {cfg.draft_sample_method!r}; choose from "
                             f"{', '.join(DRAFT_SAMPLE_METHODS)}")
        if cfg.draft_sample_method != "greedy" and draft_model is None:
            raise ValueError(f"draft_sample_method={cfg.draft_sample_method!r} needs a draft model "
                             "(prompt lookup drafts are deterministic)")
        if cfg.speculative_tokens:
            if cfg.speculative_method == "draft":
                self.proposer = DraftModelProposer(draft_model, cfg.speculative_tokens,
                                                   self.max_model_len + cfg.speculative_tokens,
                                                   vocab_size=self.vocab_size,
                                                   sample_method=cfg.draft_sample_method, rows=self.B)
            else:
                self.proposer = NgramProposer(cfg.speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        self.spec_policy = SpecPolicy(cfg.speculative_adaptive and not cfg.speculative_batch_invariant,
                                      cfg.speculative_cost)
        if runner is None:
            runner = ModelRunner(model, max_num_seqs=self.B, max_model_len=self.max_model_len,
                                 prefill_chunk_sizes=cfg.prefill_chunk_sizes, kv_dtype=kv_dtype,
                                 index_dtype=cfg.index_dtype, num_blocks=num_blocks, class_masks=class_table,
                                 stop_mask=stop_mask, images=images, spec_tokens=cfg.speculative_tokens,
                                 draft_q=getattr(self.proposer, "samples", False), dcp=cfg.dcp,
                                 decode_buckets=cfg.decode_buckets,
                                 token_split_min_tokens=cfg.token_split_min_tokens, plain_sampling=plain_sampling)
        elif (runner.model is not model or runner.B != self.B or runner.L != self.max_model_len
              or runner.chunk_sizes != tuple(sorted(set(cfg.prefill_chunk_sizes), reverse=True))
              or runner.kv_dtype != kv_dtype or runner.spec.num_blocks != num_blocks
              or (cfg.index_dtype is not None and runner.index_dtype != cfg.index_dtype)
              or (images and not runner.images) or runner.spec_tokens != cfg.speculative_tokens
              or runner.draft_q != bool(getattr(self.proposer, "samples", False)) or runner.dcp != cfg.dcp
              or runner.buckets != tuple(sorted(set(cfg.decode_buckets)))
              or runner.token_split_min_tokens != cfg.token_split_min_tokens
              or runner.plain_sampling != plain_sampling
              or runner.tables.class_masks.shape != class_table.shape):
            raise ValueError("a shared runner must have this engine's model, max_num_seqs, max_model_len, prefill "
                             "chunk sizes, cache pool (kv / index dtype, num_blocks), image programs, "
                             "speculative_tokens and draft sample method (a verify program with q exactly for "
                             "sampled drafts), dcp, token-split threshold, decode buckets and plain-sampler "
                             "programs")
        self.runner = mirror_runner(runner, self.mirror) if self.mirror.multiprocess else runner
        self._cache_bytes_per_device = runner.cache_bytes_per_device()
        self._checkpoint_bytes_per_device = runner.cache1_bytes_per_device()
        # this engine's class table (its dynamic rows are its own), passed to every step: engines may share a runner
        self._tables = runner.tables
        layout = runner.spec.layout
        self.checkpoint_blocks = cfg.prefix_checkpoint_blocks or checkpoint_interval(
            layout.state_bytes_per_sequence, layout.page_bytes * runner.dcp,
            most=-(-self.max_model_len // runner.block_tokens))
        self.max_checkpoints = cfg.prefix_checkpoints or max(self.B, MIN_DEFAULT_CHECKPOINTS)
        self.alloc, self.prefix_cache, self._block_table = self._new_pages()
        self.prefix_query_tokens = 0  # prompt tokens of new requests looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, served from it
        self.prefix_hits = 0  # new requests that resumed from a checkpoint
        self.rows = RowParams(self.B, self.vocab_size)
        self.listeners: list = []  # objects with on_request_done(RequestDone) (metrics), called on the engine thread

        self._inbox: "queue.Queue" = queue.Queue()
        self._abort_posted: set = set()  # ids passed to abort() whose inbox message is not handled yet
        self._waiting: deque = deque()
        self._vision_pending = False  # the queue's head waits for its images' tower programs to compile
        self._prefilling: Optional[_Prefill] = None
        self._blocked_head: Optional[tuple] = None  # scheduler._admission_inputs() when admitting the head last failed
        self._orders = 0
        self._requests: dict[str, _Request] = {}
        self._free: list[int] = list(range(self.B - 1, -1, -1))  # pop() gives slot 0 first
        self._running: dict[int, _Seq] = {}  # slot -> sequence
        self._inflight = None  # overlap._Step: a decode step dispatched, its tokens not read yet
        self._fed_ahead: dict = {}  # slot -> sequence: whose next token a step in flight feeds (overlap.py)
        self._state = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._seed_rng = random.SystemRandom()
        self.error: Optional[BaseException] = None
        self.started = False
        self._recovering = False  # a step failed: the state is being rebuilt (see `_recover`)
        self.step_failures = 0  # steps that raised and were recovered from
        # counters (written by the engine thread, read anywhere)
        self.num_steps = 0
        self.steps_overlapped = 0  # decode steps dispatched before the previous step's tokens were read
        self.steps_plain = 0  # decode / verify steps that ran the plain sampler
        # host seconds spent dispatching one-token decode steps (the jitted call: argument handling, XLA's launch of
        # the program and its command buffers) and blocked reading their tokens (the device still running them)
        self.step_dispatch_seconds = 0.0
        self.step_wait_seconds = 0.0
        self.steps_by_rows: dict[int, int] = {}  # decode / verify steps per program width (a bucket, or max_num_seqs)
        self.num_prefill_chunks = 0
        self.token_split_prefill_tokens = 0  # prompt tokens prefilled by token-split chunks
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_finished = 0
        self.num_preemptions = 0
        self.images_encoded = 0
        self.spec_steps = 0  # verify steps run
        self._q_zeros = None  # [B, k, V] zeros: the q a deterministic proposer hands a runner that takes q
        self.spec_drafted = 0  # draft tokens proposed into them
        self.spec_accepted = 0  # of those, accepted
        self.compile_seconds = 0.0
        self.compilations_at_start: Optional[int] = None

    # ================================================================================================ lifecycle
    def start(self) -> "Engine":
        """Compile every program, allocate the batch state and start the engine thread."""
        if self.started:
            return self
        compile_watch.install()
        t = self.runner.compile(parallel=self.config.parallel_compile)
        if isinstance(self.proposer, DraftModelProposer):  # its feed programs too: serving compiles nothing
            t0 = time.perf_counter()
            self.proposer.warmup()
            t += time.perf_counter() - t0
        self.compile_seconds = t
        self._state = self.runner.new_state()
        self._dyn_dirty = True  # compile the bitmask upload now (zero rows): serving compiles nothing
        self._upload_dynamic_masks()
        self.compilations_at_start = compile_watch.compile_count()
        if self.config.vision_warmup and self.model.vision is not None and self.runner.images and self.mirror.leader:
            buckets = patch_buckets(self.model.config.vision)
            programs_for(self.model.vision).prepare(buckets)
            log.info("vision tower: compiling %d patch buckets (%d..%d patches) in the background", len(buckets),
                     buckets[0], buckets[-1])
        log.info("engine ready: %d slots x %d tokens, %d pages of %d positions (%s latent, %s index keys; DCP %d; "
                 "%.1f MiB of cache per device), prefill chunks %s, %d programs compiled in %.1fs", self.B,
                 self.max_model_len, self.alloc.num_blocks - 1, self.alloc.block_tokens, self.runner.kv_dtype,
                 self.runner.index_dtype, self.runner.dcp, self._cache_bytes_per_device / 2**20,
                 list(self.runner.chunk_sizes), len(self.runner.program_names), t)
        if self.runner.dcp > 1:
            log.info("%s", self.runner.token_split_summary())
        if self.proposer is not None:
            cfg = self.config
            if isinstance(self.proposer, DraftModelProposer):
                dcfg = self.proposer.model.config
                how = (f"a draft model ({dcfg.architecture}, {dcfg.num_layers} layers, "
                       f"{self.proposer.sample_method} drafts)")
            else:
                how = f"prompt lookup (n-grams {cfg.prompt_lookup_max}..{cfg.prompt_lookup_min})"
            log.info("speculative decoding: up to %d drafts per step by %s, %s policy", cfg.speculative_tokens, how,
                     "adaptive" if cfg.speculative_adaptive else "always-verify")
        self._thread = threading.Thread(target=self._loop, name="kimi-jax-engine", daemon=True)
        self.started = True
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.started and self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """Alive and not rebuilding its state after a failed step: new requests are taken."""
        return self.alive and not self._recovering

    def queued_requests(self) -> int:
        """Requests submitted and not yet running (queued, or in their prefill): what admission control bounds.
        Read from any thread (a snapshot: the engine thread moves requests on meanwhile)."""
        return sum(1 for r in list(self._requests.values()) if not r.seqs and not r.done)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()

    # ================================================================================================ public API
    def submit(self, prompt_ids: Sequence[int], params: Optional[SamplingParams] = None, *, n: int = 1,
               request_id: Optional[str] = None, guide_factory: Optional[Callable[[], Guide]] = None,
               loop=None, images: Optional[Sequence[np.ndarray]] = None) -> RequestStream:
        """Queue a request; returns its stream.  Raises ``ParamError`` for bad input, ``EngineDeadError`` if the
        engine is not running.  ``images``: uint8 RGB ``[H, W, 3]`` arrays, one per image of the prompt, whose
        ``<|media_pad|>`` tokens the prompt already holds expanded (``modules.vision.expand_image_pads``)."""
        if self.error is not None:
            raise EngineDeadError(f"engine died: {self.error!r}")
        if not self.alive:
            raise EngineDeadError("engine is not running (not started, or shut down)")
        if self._recovering:
            raise EngineUnavailableError("the engine is rebuilding its state after a failed step")
        params = (params or SamplingParams()).validate(self.vocab_size)
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise ParamError("the prompt is empty", "prompt")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ParamError(f"prompt token ids must lie in [0, {self.vocab_size})", "prompt")
        if len(ids) >= self.max_model_len:
            raise ParamError(f"the prompt has {len(ids)} tokens; this server's max_model_len is "
                             f"{self.max_model_len} (prompt + at least one generated token)", "messages")
        if not isinstance(n, int) or not 1 <= n <= self.B:
            raise ParamError(f"n must be an integer in [1, {self.B}] (max_num_seqs), got {n!r}", "n")
        need = n * self.alloc.blocks_for_tokens(len(ids))
        if need > self.alloc.num_blocks - 1:
            raise ParamError(f"{n} sequence(s) of a {len(ids)}-token prompt need {need} cache pages of "
                             f"{self.alloc.block_tokens} "
                             f"tokens; this server's pool has {self.alloc.num_blocks - 1}", "n")
        prompt_images = self._check_images(ids, images) if images is not None and len(images) else None
        if guide_factory is not None:  # a guide that cannot be built fails here, not on the engine thread
            try:
                guide_factory()
            except Exception as e:  # noqa: BLE001 -- any failure of the caller's factory is a bad request
                raise ParamError(f"the guide cannot be built: {e}", "guide") from None
        rid = request_id or uuid.uuid4().hex
        if rid in self._requests:
            raise ParamError(f"request id {rid!r} is already in use", "request_id")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        stream = RequestStream(rid, loop)
        req = _Request(rid, ids, params, n, stream, guide_factory, seed, time.monotonic(), images=prompt_images)
        self._requests[rid] = req
        self._inbox.put(("submit", req))
        return stream

    def _check_images(self, ids: list, images) -> PromptImages:
        vision = getattr(self.model, "vision", None)
        if vision is None:
            raise ParamError("this model has no vision tower: it cannot take images", "images")
        if not self.runner.images:
            raise ParamError("this engine was built without image prefill programs (EngineConfig.images=False)",
                             "images")
        pi = PromptImages.create(ids, images, self.model.config.vision)
        # the decode step reads token embeddings only: every image token must go through a prefill chunk
        chunks, _ = self.runner.plan_chunks(len(ids) - 1)
        if pi.end > sum(chunks):
            raise ParamError(f"the prompt's image tokens end at position {pi.end}, but with prefill chunk sizes "
                             f"{list(self.runner.chunk_sizes)} only its first {sum(chunks)} tokens are prefilled (the "
                             "rest ride the decode steps); add text after the image or 1 to the prefill chunk sizes",
                             "images")
        return pi

    def abort(self, request_id: str) -> None:
        """Stop a request (queued, prefilling or running); its slots are freed on the next iteration.  A prefill in
        progress stops at its next chunk (not after the whole prompt)."""
        self._abort_posted.add(request_id)
        self._inbox.put(("abort", request_id))

    def generate(self, prompt_ids: Sequence[int], params: Optional[SamplingParams] = None, *, n: int = 1,
                 guide_factory=None) -> list[SequenceOutput]:
        """Blocking convenience: submit and collect the ``n`` finished sequences."""
        outs, _ = self.submit(prompt_ids, params, n=n, guide_factory=guide_factory).collect(n)
        return outs

    def stats(self) -> dict:
        running_reqs = {s.req.request_id for s in list(self._running.values())}
        pre = self._prefilling
        total = self.alloc.num_blocks - 1
        free = self.alloc.free_blocks
        cached = self.prefix_cache.stats()
        return {
            "alive": self.alive,
            "healthy": self.healthy,
            "step_failures": self.step_failures,
            "max_num_seqs": self.B,
            "max_model_len": self.max_model_len,
            "free_slots": len(self._free),
            "total_blocks": total,  # cache pages (per DCP rank), the null page aside
            "free_blocks": free,
            "used_blocks": total - free,
            # of used_blocks: pages only the prefix cache holds (evicted before anything waits for pages)
            "prefix_cache_blocks": cached["reclaimable_pages"],
            "block_tokens": self.alloc.block_tokens,  # sequence positions one page id covers (64 · dcp)
            "dcp": self.runner.dcp,
            "processes": self.mirror.channel.size if self.mirror.multiprocess else 1,
            "cache_bytes_per_device": self._cache_bytes_per_device,
            "max_cached_tokens": self.runner.max_cached_tokens,
            "kv_dtype": self.runner.kv_dtype,
            "index_dtype": self.runner.index_dtype if self.runner.spec.index_format is not None else None,
            "num_preemptions": self.num_preemptions,
            "images_encoded": self.images_encoded,
            "running_seqs": len(self._running),
            "num_requests_running": len(running_reqs),
            "num_requests_waiting": len(self._waiting) + self._inbox.qsize() + (1 if pre is not None else 0),
            "num_steps": self.num_steps,
            "async_scheduling": self.async_scheduling,
            "steps_overlapped": self.steps_overlapped,
            "steps_plain": self.steps_plain,  # decode / verify steps that ran the plain sampler (plain_sampling)
            # one-token decode steps: host seconds in their dispatch, and blocked reading their tokens; per step
            # against the step period, a host-bound loop dispatches most of the time and barely waits
            "step_dispatch_seconds": round(self.step_dispatch_seconds, 6),
            "step_wait_seconds": round(self.step_wait_seconds, 6),
            "steps_by_rows": {str(k): v for k, v in sorted(self.steps_by_rows.items())},
            "num_prefill_chunks": self.num_prefill_chunks,
            # prompt tokens whose prefill chunk ran split by tokens over the context axis, and the sizes that do
            "token_split_prefill_tokens": self.token_split_prefill_tokens,
            "token_split_chunk_sizes": list(self.runner.token_split_sizes),
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "requests_finished": self.requests_finished,
            "compilations": compile_watch.compile_count(),
            "compilations_at_start": self.compilations_at_start,
            "compile_seconds": round(self.compile_seconds, 2),
            "prefix_caching": self.prefix_cache.enabled,
            "prefix_cache_pages": cached["pages"],  # pages in the cache, read by running sequences or not
            "prefix_cache_checkpoints": cached["checkpoints"],
            "prefix_cache_max_checkpoints": self.max_checkpoints,
            "prefix_checkpoint_blocks": self.checkpoint_blocks,
            "prefix_checkpoint_bytes_per_device": self._checkpoint_bytes_per_device,
            "prefix_cache_hits": self.prefix_hits,  # new requests that resumed from the cache
            "prefix_cache_query_tokens": self.prefix_query_tokens,  # prompt tokens of new requests
            "prefix_cache_hit_tokens": self.prefix_hit_tokens,  # of those, served from the cache
            "prefill_chunk_sizes": list(self.runner.chunk_sizes),
            "speculative_tokens": self.runner.spec_tokens,
            "spec_verify_steps": self.spec_steps,
            "spec_draft_tokens": self.spec_drafted,
            "spec_accepted_tokens": self.spec_accepted,
            # verify / one-token step time at the current occupancy, as the policy sees it
            "spec_cost_ratio": round(self.spec_policy.cost(max(len(self._running), 1)), 3),
            "error": None if self.error is None else repr(self.error),
        }

    # ================================================================================================ the loop
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._iterate()
                except Exception as e:  # noqa: BLE001 -- a failed step ends its requests, not the engine
                    self._recover(e)
        except BaseException as e:  # noqa: BLE001 -- the engine must report, not vanish
            self.error = e
            log.exception("engine loop died")
            self._fail_all(EngineDeadError(f"engine died: {e!r}"))
            return
        self._fail_all(EngineDeadError("engine shut down"))

    def _iterate(self) -> None:
        """One engine iteration: finish the step in flight (its successor dispatched first where it can chain:
        overlap.py), else take what came in, prefill within the budget, run one decode step."""
        if self._inflight is not None and self._overlap():
            return
        idle = not (self._running or self._prefilling) and (not self._waiting or self._vision_pending)
        self._intake(block=idle)
        if self._stop.is_set():
            return
        self._prefill_some()
        if self._running:
            self._decode()

    RECOVERY_BACKOFF_S = (0.1, 5.0)  # first and longest wait between probe steps while the device keeps failing

    def _recover(self, error: Exception) -> None:
        """A step (prefill, decode, vision, a cache copy) raised: the batch state may be half-updated, so every
        request in the engine ends with ``RequestFailedError``, every slot, page and prefix-cache checkpoint is released,
        and the state is rebuilt.  ``healthy`` is False (``submit`` refuses) until a probe step -- the compiled
        decode step over empty rows -- runs on the new state; while it keeps failing it is retried with a growing
        wait, and the engine never hangs a caller (every stream gets its error at once)."""
        log.error("engine step failed; ending the %d request(s) in the engine and rebuilding its state",
                  len(self._requests), exc_info=error)
        self._recovering = True
        self.step_failures += 1
        failed = RequestFailedError("the engine failed while running this request")
        for req in list(self._requests.values()):
            for seq in req.seqs:
                if self.proposer is not None:
                    self.proposer.forget(seq.key)
                self.spec_policy.forget(seq.key)
            req.done = True
            req.stream.put(failed)
        self._requests.clear()
        self._reset_batch()
        delay, longest = self.RECOVERY_BACKOFF_S
        while not self._stop.is_set():
            try:
                self._state = self.runner.new_state()
                self._probe_step()
                break
            except Exception as e:  # noqa: BLE001 -- still failing: wait, then try again
                log.warning("engine probe step failed (%s); retrying in %.1f s", type(e).__name__, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, longest)
        self._recovering = False
        if not self._stop.is_set():
            log.info("engine state rebuilt after a failed step; taking requests again")

    def _reset_batch(self) -> None:
        """Forget every sequence: all slots and pages free, no prefill, an empty prefix cache, default row params."""
        self._inflight, self._fed_ahead = None, {}
        self._waiting.clear()
        self._running.clear()
        self._prefilling = None
        self._blocked_head = None
        self._vision_pending = False
        self._free = list(range(self.B - 1, -1, -1))
        self.alloc, self.prefix_cache, self._block_table = self._new_pages()
        self.rows = RowParams(self.B, self.vocab_size)

    def _new_pages(self) -> tuple[BlockAllocator, PrefixCache, BlockTable]:
        """An empty page pool, the prefix cache over it and the decode step's block table (kept across steps)."""
        alloc = BlockAllocator(self.runner.spec.num_blocks, self.runner.block_tokens)
        prefix = PrefixCache(alloc, enabled=self.config.prefix_caching, max_checkpoints=self.max_checkpoints,
                             checkpoint_blocks=self.checkpoint_blocks)
        return alloc, prefix, BlockTable(self.B, self.runner.max_blocks)

    def _probe_step(self) -> None:
        """Run the compiled decode step once with every row free (they write only the null page) and wait for it."""
        B = self.B
        tables = np.zeros((B, self.runner.max_blocks), np.int32)
        self._state, out = self.runner.step(self._state, np.zeros(B, np.int32), np.zeros(B, bool),
                                            self.rows.device(self.runner.put_rows),
                                            Controls(**empty_controls(B, self.vocab_size)), tables,
                                            sampling_tables=self._tables)
        jax.block_until_ready(out)

    def _fail_all(self, err: EngineDeadError) -> None:
        for req in list(self._requests.values()):
            req.stream.put(err)
        self._requests.clear()

    def _intake(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                if payload.done:  # ended by a failed step before it was taken in (`_recover`)
                    pass
                elif payload.aborted:
                    self._finish_request(payload)
                else:
                    self._waiting.append(payload)
            elif kind == "abort":
                self._abort(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _abort(self, request_id: str) -> None:
        self._abort_posted.discard(request_id)
        req = self._requests.get(request_id)
        if req is None or req.done:
            return
        req.aborted = True
        if req in self._waiting:
            self._waiting.remove(req)
            self._finish_request(req)
        elif self._prefilling is not None and self._prefilling.req is req and self._prefilling.seq is None:
            self._cancel_prefill()
            self._finish_request(req)
        elif req.seqs:
            for seq in req.seqs:
                if seq.finish_reason is None:
                    self._end_seq(seq, "abort", None, [])
        # else: still in the inbox; dropped when it is taken out

    # ------------------------------------------------------------------------------------------------ decode
    def _decode(self) -> None:
        B, V = self.B, self.vocab_size
        self._grow()
        if not self._running:
            return
        tokens = np.zeros(B, np.int32)
        active = np.zeros(B, bool)
        c = empty_controls(B, V)
        failed = []
        constraints = {}  # slot -> the guide's constraint for this step's token (guided rows that emit)
        for slot, seq in self._running.items():
            emit = len(seq.pending) == 1
            if emit and seq.guide is not None:
                try:
                    con = seq.guide.constraint()
                    if con is not None and len(con.ids) > MAX_ALLOWED_IDS:
                        raise ValueError(f"a guide allowed {len(con.ids)} explicit ids; at most {MAX_ALLOWED_IDS}")
                except Exception:  # noqa: BLE001 -- one request's guide must not take the engine down
                    log.exception("guide of request %s failed; aborting that sequence", seq.req.request_id)
                    failed.append(seq)
                    continue
                constraints[slot] = con
                if con is not None:
                    c["allow_class"][slot] = self._constraint_class(con, slot, 0)
                    c["allow_ids"][slot, : len(con.ids)] = con.ids
            tokens[slot] = seq.pending[0]
            active[slot] = True
            c["emit"][slot] = emit
            c["gen_step"][slot] = len(seq.output_ids)
        for seq in failed:
            self._end_seq(seq, "abort", None, seq.text.finish())
        if not self._running:
            return
        ctl = Controls(**c)
        proposer, policy = self.proposer, self.spec_policy  # read once: a benchmark or test may swap them
        t_draft = time.perf_counter()
        drafts, later = ({}, {}) if proposer is None else self._draft(proposer, policy, c["emit"], int(active.sum()),
                                                                         constraints)
        # what drafting cost (a draft model's forward passes) is part of what a verify step costs the policy
        t_draft = time.perf_counter() - t_draft if drafts else 0.0
        # null rows for free slots (they write nothing); updated in place: no step is in flight here
        tables = self._block_table.update({slot: self.alloc.held(seq.key) for slot, seq in self._running.items()})
        if proposer is not None and policy.measures:
            # the policy times each step from its inputs to its tokens handed out: first wait for what is still
            # queued in front of it (prefill chunks and slot inserts dispatched this iteration are never read back),
            # so that a step's time is its own. On the H200 that queued work put a verify step of 32
            # rows at 4.5-4.8x a one-token step (2.0x timed after it), and the policy stopped verifying drafts that
            # were all kept
            jax.block_until_ready(self._state)
        t0 = time.perf_counter()
        verified = bool(drafts) or (proposer is not None and self.config.speculative_batch_invariant)
        slots = self._bucket_slots()
        pick = (lambda a: a) if slots is None else (lambda a: a[slots])  # the bucket's rows of a [B, ...] input
        plain = self._plain_sampler()
        if not verified:
            self._upload_dynamic_masks()
            rows = self.rows.device(self.runner.put_rows)
            step = self._dispatch(pick(tokens), pick(active), rows, Controls(*map(pick, ctl)), pick(tables), slots,
                                  dict(self._running), c["emit"], plain)
            if proposer is None and self.async_scheduling:
                self._inflight = step  # read by the next iteration, after it dispatches the step after it
                return
            self._finish_step(step)
        else:
            self._count_step(slots, plain)
            ids, n_draft, vctl = self._verify_inputs(tokens, ctl, drafts, later)
            self._upload_dynamic_masks()
            q = self._draft_q(proposer, drafts) if self.runner.draft_q else {}
            rows = self.rows.device(self.runner.put_rows)
            q = {k: pick(v) for k, v in q.items()}
            self._state, out = self.runner.verify(self._state, pick(ids), pick(n_draft), pick(active), rows,
                                                  Controls(*map(pick, vctl)), pick(tables), **q,
                                                  sampling_tables=self._tables, slots=slots, plain=plain)
            out = self._by_slot({k: np.asarray(v) for k, v in out._asdict().items()}, slots)
            self._count_verify(policy, drafts, n_draft, out["n"])
            self._advance(out, c["emit"], dict(self._running))
        if proposer is not None:
            for slot, seq in self._running.items():
                if slot not in drafts:
                    policy.idle(seq.key)
        # the whole step, its tokens handed out included (a verify step hands out up to k + 1 per row): on the H200
        # a verify step of 32 rows took 1.8x a one-token step from dispatch to results, 2.0x this way
        policy.timed(verified, time.perf_counter() - t0 + t_draft, int(active.sum()))

    def _finish_step(self, step) -> None:
        """Read a decode step's tokens (waiting for it) and hand them out."""
        t0 = time.perf_counter()
        host = {k: np.asarray(v)[:, None] for k, v in step.out._asdict().items()}
        self.step_wait_seconds += time.perf_counter() - t0
        out = self._by_slot(host, step.slots)
        out["n"] = np.ones(self.B, np.int32)  # one position per row
        self._advance(out, step.emit, step.seqs)

    def _advance(self, out: dict, emit: np.ndarray, seqs: dict) -> None:
        """Move the sequences a step ran (`seqs`: slot -> sequence) past its outputs (by slot: ``n`` positions fed per
        row, ``tokens`` / ``logprob`` / ``top_ids`` / ``top_logprobs`` ``[B, n]``); rows that emit hand their tokens
        out. A sequence that ended since the step was dispatched is skipped."""
        self.num_steps += 1
        now = time.monotonic()
        for slot, seq in list(self._running.items()):
            if seqs.get(slot) is not seq:
                continue
            n = int(out["n"][slot])
            seq.pending.popleft()
            seq.fed += n  # the fed token and the n - 1 accepted drafts are in the cache now
            if not emit[slot]:
                continue
            for j in range(n):
                if seq.finish_reason is not None:
                    break
                self._emit(seq, int(out["tokens"][slot, j]), float(out["logprob"][slot, j]),
                           out["top_ids"][slot, j], out["top_logprobs"][slot, j], now)
            if seq.finish_reason is None:
                for _ in range(n - 1):  # accepted drafts were fed already; only the last token is still to feed
                    seq.pending.popleft()

    def _plain_sampler(self) -> bool:
        """Whether this step may run the plain sampler: the runner has its programs and no running sequence samples
        through the filter or returns top log-probs (the rows of free slots are never read)."""
        return self.runner.plain_sampling and not self.rows.needs_branches(self._running)

    def _count_step(self, slots: Optional[np.ndarray], plain: bool) -> None:
        """Count a decode or verify step under its program width (`steps_by_rows`): its bucket, or all B rows; and
        in `steps_plain` when it runs the plain sampler."""
        self.steps_plain += plain
        width = self.B if slots is None else len(slots)
        self.steps_by_rows[width] = self.steps_by_rows.get(width, 0) + 1

    def _bucket_slots(self) -> Optional[np.ndarray]:
        """The slots this step runs over: None (all B) when no compiled bucket is smaller, else the running slots
        and enough free ones (inactive rows) to fill the smallest bucket that holds them."""
        b = self.runner.bucket_for(len(self._running))
        if b is None:
            return None
        busy = sorted(self._running)
        return np.asarray(busy + sorted(set(range(self.B)) - set(busy))[: b - len(busy)], np.int32)

    def _by_slot(self, out: dict, slots: Optional[np.ndarray]) -> dict:
        """A bucketed step's outputs (row i = slot slots[i]) laid out by slot, ``[B, ...]``."""
        if slots is None:
            return out
        full = {}
        for k, v in out.items():
            full[k] = np.zeros((self.B,) + v.shape[1:], v.dtype)
            full[k][slots] = v
        return full
