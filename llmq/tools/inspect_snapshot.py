"""What `llmq inspect` shows: the queue, the engines, the batches in progress and the latest
webhook deliveries, read from Redis (``snapshot``) and put on one screen (``render``)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict

import redis

from llmq.common.engine_status import EngineStatus
from llmq.common.lora_adapters import AdapterRecord
from llmq.common.settings import Settings
from llmq.common.transport import GROUP, Keys
from llmq.common.transport.redis_clients import keys_for, tool_client
from llmq.common.webhooks import deliveries_key
from llmq.tools import inspect_models

# Hash fields that are text even when they look like numbers (a model named "7", an id).
_TEXT_FIELDS = frozenset({"id", "name", "model", "kind", "status", "endpoint", "hostname"})


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _number(value: str) -> int | float | str:
    """``value`` as an int or a finite float where it reads as one, else unchanged."""
    try:
        return int(value)
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        return value
    return number if math.isfinite(number) else value


def _typed(fields: dict) -> dict:
    """A Redis hash (all strings) with its numbers as numbers, for ``--json`` readers."""
    return {
        k: v if k in _TEXT_FIELDS or k.endswith("_id") else _number(v) for k, v in fields.items()
    }


def snapshot(client: redis.Redis, keys: Keys) -> dict:
    now = time.time()
    if keys.cluster:  # no SCAN across the nodes: the models workers have served
        streams = sorted(keys.requests(_s(m)) for m in client.hkeys(keys.models))
    else:
        streams = sorted({_s(k) for k in client.scan_iter(match=keys.requests_pattern, count=100)})
    queues = []
    for stream in streams:
        if client.type(stream) != b"stream":
            continue
        info = {"stream": stream, "length": client.xlen(stream), "pending": 0, "consumers": []}
        try:
            for g in client.xinfo_groups(stream):
                if _s(g["name"]) != GROUP:
                    continue
                info["pending"] = g["pending"]
                info["lag"] = g.get("lag")
            for c in client.xinfo_consumers(stream, GROUP):
                info["consumers"].append(
                    {"name": _s(c["name"]), "pending": c["pending"], "idle_s": c["idle"] / 1000}
                )
        except redis.ResponseError:
            pass
        first = client.xrange(stream, count=1)
        info["oldest_age_s"] = now - int(_s(first[0][0]).split("-")[0]) / 1000 if first else 0.0
        queues.append(info)
    engines = []
    for worker in sorted(_s(w) for w in client.zrange(keys.engines_index, 0, -1)):
        raw = client.hgetall(keys.engine(worker))
        if raw:  # its heartbeat has not expired
            status = EngineStatus.from_redis(raw, worker)
            engines.append({"name": status.worker, **status.to_redis()})
    batches = []
    for batch_id in client.smembers(keys.batches_active):
        raw = _typed({_s(k): _s(v) for k, v in client.hgetall(keys.batch(_s(batch_id))).items()})
        if raw:
            batches.append(raw)
    return {
        "queues": queues,
        "engines": engines,
        "batches": batches,
        "refused": _refused_models(client, keys),
        "adapters": [
            asdict(AdapterRecord.from_json(raw))
            for _, raw in sorted(client.hgetall(keys.loras).items())
        ],
        "webhooks": [json.loads(raw) for raw in client.lrange(deliveries_key(keys.prefix), 0, 9)],
        "on_demand": inspect_models.snapshot(client, keys),
    }


def _refused_models(client: redis.Redis, keys: Keys) -> list[dict]:
    """Models a worker refused to serve (``worker/refusal.py``), with the reason."""
    refused = []
    for model, raw in sorted(client.hgetall(keys.models).items()):
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("refused"):
            refused.append({"model": _s(model), **record})
    return refused


def speculation_line(e: dict) -> str:
    """An engine's speculative decoding so far: acceptance and tokens per checking step."""
    verified, proposed, accepted = e["spec_verified"], e["spec_proposed"], e["spec_accepted"]
    return (
        f"    speculative decoding: {accepted}/{proposed} draft tokens accepted "
        f"({100 * accepted / max(proposed, 1):.0f}%), {(accepted + verified) / verified:.2f} "
        f"tokens per checking step"
    )


def render(snap: dict) -> str:
    out = ["QUEUES"]
    if not snap["queues"]:
        out.append("  (no request stream yet)")
    for q in snap["queues"]:
        out.append(
            f"  {q['stream']}: {q['length']} in stream, {q['pending']} being served, "
            f"oldest {q['oldest_age_s']:.1f}s"
        )
        for c in q["consumers"]:
            out.append(f"    consumer {c['name']}: {c['pending']} pending, idle {c['idle_s']:.1f}s")
    out.append("ENGINES")
    if not snap["engines"]:
        out.append("  (no live worker)")
    for e in sorted(snap["engines"], key=lambda e: e["name"]):
        used, total = e["kv_blocks_used"], e["kv_blocks_total"]
        kv = f"KV {used}/{total} ({100 * used / total:.0f}%)" if total else "KV -"
        out.append(
            f"  {e['name']}: {e['model']} [{e['kind']}] {kv}, running {e['running']}, "
            f"waiting {e['waiting']}, {e['tokens_per_s']} tok/s, {e['steps_per_s']} steps/s"
        )
        cached, computed = e.get("prompt_tokens_cached", 0), e.get("prompt_tokens_computed", 0)
        if cached or computed:
            share = 100 * cached / (cached + computed)
            out.append(
                f"    prompt tokens: {cached} from cache, {computed} computed ({share:.0f}% "
                f"cached){', placement on' if e.get('placement') else ''}"
            )
        if e.get("forward_plan"):
            out.append(f"    forward: {e['forward_plan']}")
        if e.get("loras"):
            out.append(f"    LoRA adapters loaded: {e['loras'].replace(',', ', ')}")
        if e.get("spec_verified"):
            out.append(speculation_line(e))
    for r in snap.get("refused", []):
        out.append(f"  REFUSED {r['model']} (worker {r.get('worker')}): {r['refused']}")
    for a in snap.get("adapters", []):
        owner = f", owner {a['owner']}" if a.get("owner") else ""
        out.append(f"  ADAPTER {a['name']} on {a['base']} (rank {a['rank']}{owner}): {a['path']}")
    if snap.get("on_demand"):
        out.extend(inspect_models.render(snap["on_demand"]))
    out.append("BATCHES IN PROGRESS")
    if not snap["batches"]:
        out.append("  (none)")
    for b in snap["batches"]:
        out.append(
            f"  {b.get('id')}: {b.get('status')} {b.get('completed', 0)}/{b.get('total', 0)} done, "
            f"{b.get('failed', 0)} failed ({b.get('endpoint')})"
        )
    if snap.get("webhooks"):
        out.append("WEBHOOK DELIVERIES (newest first)")
    for w in snap.get("webhooks", []):
        out.append(
            f"  {w['webhook_id']} {w['type']} to {w['url']}, attempt {w['attempt']}: {w['outcome']}"
        )
    return "\n".join(out)


def show(settings: Settings, as_json: bool = False) -> int:
    """Print the snapshot, as text or as JSON; the exit status."""
    import json

    client = tool_client(settings.redis_url_or_default(), settings.redis_sentinel_master)
    snap = snapshot(client, keys_for(settings))
    print(json.dumps(snap, indent=2) if as_json else render(snap))
    return 0
