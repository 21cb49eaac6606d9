"""Speculative decoding in `llmq bench`: the workloads of ``bench/speculative.py`` as a run's
prompts, and the run's acceptance read from llmq's /metrics: the draft totals of heartbeats
written after the run's start and after its end (a server serving the run alone gives the run's
own figures; the heartbeat times are the worker's clock, which should agree with this host's).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmq.tools.bench_prompts import PromptSet
from llmq.tools.bench_workloads import workload_chats

if TYPE_CHECKING:
    import httpx

WORKLOADS = tuple(workload_chats())
_GAUGES = {
    "llmq:engine_heartbeat_time": "heartbeat",
    "llmq:spec_decode_num_drafts": "drafts",
    "llmq:spec_decode_num_draft_tokens": "draft_tokens",
    "llmq:spec_decode_num_accepted_tokens": "accepted_tokens",
}
# How long a heartbeat written after a moment may take to come (a few heartbeat periods).
CATCH_UP_S = 15.0


def workload_prompts(name: str, count: int) -> PromptSet:
    """``count`` chats of the workload, its four variants in turn."""
    chats = workload_chats()[name][1]
    texts = [chats[i % len(chats)] for i in range(count)]
    return PromptSet(texts, [None] * count, None, measured=False)


@dataclass
class SpecTotals:
    heartbeat: float = 0.0
    drafts: float = 0
    draft_tokens: float = 0
    accepted_tokens: float = 0


async def spec_totals(http: httpx.AsyncClient, root: str, model: str) -> SpecTotals | None:
    """The model's totals in ``root``/metrics (None: no llmq metrics there)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await http.get(f"{root}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200 or "llmq:engine_heartbeat_time" not in r.text:
        return None
    totals = SpecTotals()
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            field = _GAUGES.get(sample.name)
            if field and sample.labels.get("model_name", model) == model:
                setattr(totals, field, getattr(totals, field) + sample.value)
    return totals


async def totals_after(
    http: httpx.AsyncClient, root: str, model: str, moment: float
) -> SpecTotals | None:
    """The totals of heartbeats written after ``moment`` (unix time); None where the server
    has no llmq metrics or no such heartbeat comes."""
    deadline = time.monotonic() + CATCH_UP_S
    while (totals := await spec_totals(http, root, model)) is not None:
        if totals.heartbeat > moment:
            return totals
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.2)
    return None


def spec_figures(before: SpecTotals | None, after: SpecTotals | None) -> dict | None:
    """The drafts checked between two totals: acceptance and mean tokens per checking step;
    None where the server reports no speculation."""
    if before is None or after is None or not after.drafts:
        return None
    drafts = int(after.drafts - before.drafts)
    proposed = int(after.draft_tokens - before.draft_tokens)
    accepted = int(after.accepted_tokens - before.accepted_tokens)
    return {
        "drafts": drafts,
        "draft_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance": accepted / proposed if proposed else None,
        "mean_accepted_length": (accepted + drafts) / drafts if drafts else None,
    }


def format_spec(spec: dict | None) -> list[str]:
    if spec is None:
        return []
    if not spec["drafts"]:
        return ["  speculative decoding: no drafts checked"]
    return [
        f"  speculative decoding: {spec['accepted_tokens']}/{spec['draft_tokens']} draft tokens "
        f"accepted ({spec['acceptance']:.0%}), {spec['mean_accepted_length']:.2f} tokens per "
        "checking step"
    ]
