"""The serving engine: continuous batching over fixed cache slots, a fused jitted decode+sample step, guided decoding.

    engine = Engine(model, tokenizer, max_num_seqs=8, max_model_len=512).start()
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=16, temperature=0.0))

See ``engine.py`` for the request life cycle and the seams for prefix caching and speculative decoding.
"""

from .engine import Engine, EngineConfig
from .guide import Constraint, Guide, ProgramGuide, TokenSequenceGuide
from .request import (EngineDeadError, EngineError, EngineUnavailableError, RequestDone, RequestFailedError, RequestStream, SeqEvent, SequenceOutput, TokenLogprob)
from .sampling_params import ParamError, SamplingParams

__all__ = ["Engine", "EngineConfig", "Constraint", "Guide", "ProgramGuide", "TokenSequenceGuide", "EngineDeadError",
           "EngineError", "EngineUnavailableError", "RequestFailedError", "RequestDone", "RequestStream", "SeqEvent", "SequenceOutput", "TokenLogprob", "ParamError",
           "SamplingParams"]
