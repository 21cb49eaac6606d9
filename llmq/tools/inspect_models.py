"""`llmq inspect`'s models on demand: the catalogue with each model's state, what each worker
holds against its budget and until when, the loads in progress and waited for, the failed."""

from __future__ import annotations

import time

import redis

from llmq.common.catalogue import decode, fresh_residents, holders, sleepers, state_of
from llmq.common.transport import Keys


def snapshot(client: redis.Redis, keys: Keys) -> dict:
    now = time.time()
    catalogue = decode(client.hgetall(keys.catalogue))
    residents = fresh_residents(client.hgetall(keys.resident), now)
    loading = {
        r["model"]: {"worker": w, "for_s": round(now - float(r.get("since", now)), 1)}
        for w, r in decode(client.hgetall(keys.loading)).items()
        if float(r.get("until", 0)) > now
    }
    wanted = decode(client.hgetall(keys.wanted))
    failed = decode(client.hgetall(keys.load_failed))
    models = []
    for name, entry in sorted(catalogue.items()):
        state = state_of(residents, name, name in loading)
        held_by = sleepers(residents, name) if state == "sleeping" else holders(residents, name)
        model = {"name": name, "state": state, "workers": held_by, "size": entry.get("size", 0)}
        if name in loading:
            model["loading"] = loading[name]
        if name in wanted:
            model["waited_for_s"] = round(now - float(wanted[name].get("since", now)), 1)
        if name in failed:
            model["failed"] = failed[name].get("error")
        models.append(model)
    return {"models": models, "workers": residents}


def render(snap: dict) -> list[str]:
    if not snap["models"]:
        return []
    out = ["MODELS ON DEMAND"]
    for m in snap["models"]:
        line = f"  {m['name']} ({m['size'] / 2**20:.0f} MB): {m['state']}"
        if m["workers"]:
            line += f" on {', '.join(m['workers'])}"
        if "loading" in m:
            line += f" by {m['loading']['worker']} for {m['loading']['for_s']} s"
        if "waited_for_s" in m:
            line += f", requests waiting {m['waited_for_s']} s"
        if "failed" in m:
            line += f"; last load failed: {m['failed']}"
        out.append(line)
    now = time.time()
    for worker, r in sorted(snap["workers"].items()):
        budget = f"{r['budget'] / 2**20:.0f} MB" if r.get("budget") else "no limit"
        held = []
        for name, h in sorted(r.get("models", {}).items()):
            until = h.get("expires_at")
            held.append(f"{name} (until unloaded in {until - now:.0f} s)" if until else name)
        held += [f"{name} (asleep)" for name in sorted(r.get("asleep", {}))]
        out.append(
            f"  worker {worker}: {r.get('held', 0) / 2**20:.0f} MB of {budget} held: "
            f"{', '.join(held) or 'nothing'}"
        )
    return out
