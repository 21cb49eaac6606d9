"""The playground at `/`: a plain HTML + JS chat that streams from /v1/chat/completions."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()


@cache
def _page() -> str:
    return (Path(__file__).parent / "static" / "playground.html").read_text()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(_page())
