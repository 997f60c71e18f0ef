"""What the server says about itself: ``router`` (open to all) has /health, /metrics (Prometheus, ``metrics.py``),
/stats (the engine's counters) and /version; ``models_router`` (behind the API key) has /v1/models and
/v1/models/{id}."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from .. import __version__
from .errors import APIError
from .metrics import CONTENT_TYPE
from .state import ServerState, get_state, require_key

router = APIRouter()
models_router = APIRouter(dependencies=[Depends(require_key)])


@router.get("/health")
async def health(st: ServerState = Depends(get_state)):
    """200 while the engine takes requests; 503 once it died, while it rebuilds its state after a failed step,
    and while the server shuts down."""
    err = st.unready_error()
    if err is None:
        return Response(status_code=200)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


@router.get("/metrics")
async def metrics(st: ServerState = Depends(get_state)):
    return Response(st.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/stats")
async def stats(st: ServerState = Depends(get_state)):
    return st.engine.stats()


@router.get("/version")
async def version():
    return {"version": __version__}


@models_router.get("/v1/models")
async def models(st: ServerState = Depends(get_state)):
    return {"object": "list", "data": [model_card(st)]}


@models_router.get("/v1/models/{model_id:path}")
async def model(model_id: str, st: ServerState = Depends(get_state)):
    if model_id != st.model_name:
        raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
    return model_card(st)


def model_card(st: ServerState) -> dict:
    """The served model as OpenAI's model object (plus vLLM's ``max_model_len``)."""
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "kimi_jax",
            "root": st.model_name, "parent": None, "max_model_len": st.engine.max_model_len}
