"""Models on demand: the catalogue of models a fleet may load (LLMQ_CATALOGUE: model folders,
GGUF files, directories of them), Ollama's ``keep_alive`` durations, and the records workers
and the API share in Redis (keys ``catalogue``, ``wanted``, ``load:{model}``, ``load_failed``,
``keep_alive``, ``resident``, ``unload``; see ``transport/keys``).

A request names a catalogue model no worker holds: the API writes a wish (``wanted``) and
waits; a worker with room claims the load (``load:{model}``, a TTL renewed while it loads, so
a worker killed mid-load leaves it to another), evicts its least recently used idle model if
it must, loads, and serves. A failed load is recorded (``load_failed``) for the waiters."""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from llmq.common.model_ids import short_id

log = logging.getLogger(__name__)

# Files whose bytes count toward a model folder's size (its weights).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
# A failed load answers the requests for that model at once for this long (a bad file is not
# read again on every request); after it, a request tries the load again.
FAILED_LOAD_HOLD_S = 10.0
# A worker's resident record older than this is a dead worker's.
RESIDENT_STALE_S = 10.0
FOREVER = -1.0


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    source: str
    size: int  # bytes of its weight files

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _is_model(path: Path) -> bool:
    if path.is_file():
        return path.suffix.lower() == ".gguf"
    return path.is_dir() and (path / "config.json").is_file()


def model_size(path: Path) -> int:
    """Bytes of a model's weights: a GGUF file's size, or a folder's weight files'."""
    if path.is_file():
        return path.stat().st_size
    return sum(
        f.stat().st_size
        for f in path.iterdir()
        if f.is_file() and f.suffix.lower() in _WEIGHT_SUFFIXES
    )


def scan(spec: str) -> dict[str, Entry]:
    """The catalogue ``spec`` (comma-separated paths) names: each model folder or GGUF file,
    and those directly in a directory that is neither; named by short id, the first of a name
    kept."""
    found: dict[str, Entry] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        path = Path(item).expanduser()
        if _is_model(path):
            paths = [path]
        elif path.is_dir():
            paths = [p for p in sorted(path.iterdir()) if _is_model(p)]
        else:
            log.warning("catalogue: %s is no model folder, GGUF file or directory", item)
            continue
        for p in paths:
            name = short_id(str(p))
            if name in found:
                log.warning("catalogue: %s left out, %s is named %s too", p, found[name], name)
                continue
            found[name] = Entry(name, str(p.resolve()), model_size(p))
    return found


def keep_alive_seconds(value: str | float | None, default: float) -> float:
    """Ollama's keep_alive as seconds: a number (seconds) or a duration (``30s``, ``5m``,
    ``1h30m``); negative: for good (``FOREVER``); None or "": ``default``."""
    if value is None or value == "":
        return default
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            body = text.lstrip("+-")
            parts = _DURATION_PART.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(
                    f"keep_alive {value!r} is no duration: give seconds or e.g. 30s, 5m, 1h"
                ) from None
            seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
            seconds = -seconds if text.startswith("-") else seconds
    return FOREVER if seconds < 0 else seconds


def decode(raw: dict) -> dict[str, dict]:
    """A Redis hash of JSON values, as text keys to dicts (values that are not JSON left out)."""
    out: dict[str, dict] = {}
    for key, value in raw.items():
        key = key.decode() if isinstance(key, bytes) else str(key)
        try:
            parsed = json.loads(value)
        except (TypeError, ValueError):
            continue
        if isinstance(parsed, dict):
            out[key] = parsed
    return out


def fresh_residents(raw: dict, now: float | None = None) -> dict[str, dict]:
    """The ``resident`` hash's records of live workers: worker -> {models: {model: {size,
    expires_at}}, asleep: {model: {size, since}}, budget, held, loading, updated}."""
    now = time.time() if now is None else now
    return {
        w: r for w, r in decode(raw).items() if now - float(r.get("updated", 0)) < RESIDENT_STALE_S
    }


def holders(residents: dict[str, dict], model: str) -> list[str]:
    """The workers whose resident record holds ``model``."""
    return sorted(w for w, r in residents.items() if model in r.get("models", {}))


def sleepers(residents: dict[str, dict], model: str) -> list[str]:
    """The workers that have ``model`` asleep (the next request for it wakes it there)."""
    return sorted(w for w, r in residents.items() if model in r.get("asleep", {}))


def state_of(residents: dict[str, dict], model: str, loading: bool) -> str:
    """A catalogue model's state: ready (a worker holds it), loading, sleeping or available."""
    if holders(residents, model):
        return "ready"
    if loading:
        return "loading"
    return "sleeping" if sleepers(residents, model) else "available"


def expires_at(residents: dict[str, dict], model: str) -> float | None:
    """When ``model`` unloads from the last worker holding it (None: never, or not held)."""
    held = [w for w in residents if model in residents[w].get("models", {})]
    if not held:
        return None
    found = [residents[w]["models"][model].get("expires_at") for w in held]
    return None if any(t is None for t in found) else max(found)
