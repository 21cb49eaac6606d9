"""/health (process alive), /ready (Redis reachable and a worker serving), /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    registry = request.app.state.registry
    try:
        await request.app.state.redis.ping()
    except Exception as exc:
        return JSONResponse({"status": "unavailable", "reason": f"redis: {exc}"}, status_code=503)
    engines = await registry.engines()
    models = sorted({e.model for e in engines})
    if not models:
        return JSONResponse({"status": "unavailable", "reason": "no live worker"}, status_code=503)
    return {"status": "ready", "models": models, "engines": len(engines)}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = request.app.state
    try:
        engines = await state.registry.engines()
        models = {e.model for e in engines} | {state.registry.default_name}
        stats = {m: await state.transport.queue_stats(m) for m in models}
        state.metrics.observe_engines(engines, stats)
    except Exception:  # metrics stay available while Redis is down
        pass
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
