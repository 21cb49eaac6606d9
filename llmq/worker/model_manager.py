"""A worker of LLMQ_CATALOGUE: models loaded on demand, up to a memory budget, unloaded after
their keep-alive (``common/catalogue`` has the protocol).

The manager's thread ticks every ``TICK_S``: it publishes the catalogue and what this worker
holds (``resident``), unloads models whose keep-alive ran out or whose unload was asked for,
puts to sleep those asked to sleep or idle past LLMQ_SLEEP_IDLE_SECONDS (unloaded, their place
kept: listed as asleep, and woken by this worker for their next request), and takes a wish (``wanted``) it has room for: it claims the load, evicts the least recently
used idle models it must, and loads. Each loaded model is an engine loop of its own (named
``{worker}/{model}``), on a thread of its own that loads it and then runs it, as the worker's
single engine does; its heartbeat, queue and crash recovery are those of any engine.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field

from llmq.common.catalogue import (
    FOREVER,
    Entry,
    decode,
    fresh_residents,
    keep_alive_seconds,
    scan,
)
from llmq.common.settings import Settings
from llmq.common.transport.keys import as_text
from llmq.common.transport.redis_clients import engine_client, keys_for

log = logging.getLogger("llmq.worker.models")

TICK_S = 0.1
# A load's claim lapses this many heartbeat TTLs after its worker died (20 s by default).
# Renewed every RENEW_S, but a load can hold the GIL for seconds at a time (a 262k-token
# tokenizer parsed in Rust), so a shorter lapse lets a second worker load the same model.
CLAIM_TTLS = 4
RENEW_S = 1.0
RESCAN_S = 30.0
# A worker that must evict to load leaves a wish this long to workers with free room.
EVICT_DEFER_S = 0.3
LOADING_VALID_S = 10.0
# How long a model loaded for requests waits for the first of them before its keep-alive counts.
FIRST_REQUEST_S = 10.0
# A wish for a model asleep on another worker is left to that worker this long (it wakes it).
WAKE_DEFER_S = 2.0


_LOAD_IMPORTS = (
    "gguf",
    "llguidance",
    "psutil",
    "transformers.masking_utils",
    "transformers.modeling_layers",
    "transformers.modeling_gguf_pytorch_utils",
    "transformers.processing_utils",
)


@dataclass
class Held:
    entry: Entry
    loop: object  # the model's EngineLoop
    thread: threading.Thread
    loaded_at: float
    last_busy: float = field(default_factory=time.time)
    served: bool = False  # it has had a request since its load

    def busy(self) -> bool:
        return bool(self.loop.active)


@dataclass
class Asleep:
    """A model put to sleep: its engine stopped and its memory given back, its place kept (it
    is listed as sleeping, and the next request for it wakes it here)."""

    entry: Entry
    since: float


class ModelManager:
    def __init__(self, settings: Settings, worker: str):
        self.settings, self.worker = settings, worker
        self.client = engine_client(settings.redis_url_or_default(), settings.redis_sentinel_master)
        self.keys = keys_for(settings)
        self.budget = int(settings.model_memory_mb * (1 << 20))
        self.claim_ms = int(settings.heartbeat_ttl * CLAIM_TTLS * 1000)
        self.default_keep_alive = keep_alive_seconds(settings.keep_alive, 300.0)
        self.catalogue: dict[str, Entry] = {}
        self.held: dict[str, Held] = {}
        self.asleep: dict[str, Asleep] = {}
        self.sleep_idle = float(settings.sleep_idle_seconds)
        self.loading: str | None = None
        self.seen: dict[str, float] = {}  # wish -> when this worker first saw it
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="llmq-models", daemon=True)
        self._scanned = 0.0

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.warm_imports()
        self.rescan()
        log.info(
            "serving models on demand: %d in the catalogue, budget %s",
            len(self.catalogue),
            f"{self.budget / 2**20:.0f} MB" if self.budget else "unlimited",
        )
        self.thread.start()

    @staticmethod
    def warm_imports() -> None:
        """What every load needs imported, at start: the first load then takes the time a
        model's own load takes, not the imports' too (docs/performance.md, "Choices: memory")."""
        started = time.monotonic()
        import torch  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

        import llmq.worker.llm_engine  # noqa: F401
        import llmq.worker.service  # noqa: F401

        # What a first load imports lazily: counted in the idle worker, not left behind by the
        # first model unloaded.
        for name in _LOAD_IMPORTS:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
        # The libraries' objects out of the collector's sight: the full collection that frees
        # an unloaded model's cycles then looks at the models' objects only (docs/performance.md,
        # "Models on demand: the first request's wait").
        gc.collect()
        gc.freeze()
        log.info("load phase: libraries imported in %.2f s", time.monotonic() - started)

    def stop(self, grace: float | None = None) -> None:
        """Stop taking wishes; every loaded model's loop drains (``grace``) and stops."""
        self.stopping.set()
        self.thread.join(30)
        for held in list(self.held.values()):
            held.loop.stop(grace)
        for held in list(self.held.values()):
            held.thread.join((grace or 0) + 5)
        try:
            self.client.hdel(self.keys.resident, self.worker)
        except Exception as exc:
            log.debug("resident record not withdrawn: %s", exc)

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.tick()
            except Exception as exc:  # Redis away: keep trying, the engines do too
                log.warning("model manager: %s", exc)
                self.stopping.wait(1.0)
            self.stopping.wait(TICK_S)

    # ---- one tick ------------------------------------------------------------------------
    def tick(self) -> None:
        now = time.time()
        if now - self._scanned > RESCAN_S:
            self.rescan()
        self._drop_dead()
        self._expire(now)
        self.publish(now)
        wishes = decode(self.client.hgetall(self.keys.wanted))
        for model in sorted(wishes, key=lambda m: wishes[m].get("since", 0)):
            if self._take(model, wishes[model], now):
                break
        self.seen = {m: t for m, t in self.seen.items() if m in wishes}

    def rescan(self) -> None:
        self._scanned = time.time()
        self.catalogue = scan(self.settings.catalogue)
        if self.catalogue:
            self.client.hset(
                self.keys.catalogue, mapping={n: e.to_json() for n, e in self.catalogue.items()}
            )

    def held_bytes(self) -> int:
        return sum(h.entry.size for h in self.held.values())

    def keep_alive(self, model: str) -> float:
        raw = self.client.hget(self.keys.keep_alive, model)
        try:
            return float(raw) if raw is not None else self.default_keep_alive
        except ValueError:
            return self.default_keep_alive

    def publish(self, now: float) -> None:
        """This worker's resident record: what it holds and until when, its budget."""
        models = {}
        for name, held in self.held.items():
            keep = self.keep_alive(name)
            until = None if keep == FOREVER or held.busy() else held.last_busy + keep
            models[name] = {
                "size": held.entry.size,
                "expires_at": until,
                "since": held.loaded_at,
                "last_used": held.last_busy,
                "busy": held.busy(),
            }
        asleep = {n: {"size": a.entry.size, "since": a.since} for n, a in self.asleep.items()}
        record = {
            "models": models,
            "asleep": asleep,
            "budget": self.budget,
            "held": self.held_bytes(),
            "loading": self.loading,
            "updated": now,
        }
        self.client.hset(self.keys.resident, self.worker, json.dumps(record))

    # ---- unloading -----------------------------------------------------------------------
    def _drop_dead(self) -> None:
        for name, held in list(self.held.items()):
            if not held.thread.is_alive():
                log.error("the engine loop of %s stopped; the model is dropped", name)
                self.held.pop(name)

    def _idle(self, name: str, held: Held, now: float) -> bool:
        """Nothing running and nothing queued for it (its stream empty: finished entries are
        deleted), as of now."""
        if held.busy() or self.client.xlen(self.keys.for_model(name).requests(name)) > 0:
            held.last_busy, held.served = now, True
            return False
        return True

    def _expire(self, now: float) -> None:
        for name, (why, sleep) in self._expired(now).items():
            self.unload(name, why, sleep)

    def _asked(self, key: str) -> dict[str, float]:
        return {as_text(k): float(v) for k, v in self.client.hgetall(key).items()}

    def _expired(self, now: float) -> dict[str, tuple[str, bool]]:
        """The models to unload or put to sleep (True) now, and why. Apart from ``_expire``'s
        loop: a ``Held`` in its frame kept the model alive through ``unload``'s collection and
        trim (SmolLM2 left 100 MB resident after its unload)."""
        asked, sleeps = self._asked(self.keys.unload), self._asked(self.keys.sleep)
        for name, asleep in list(self.asleep.items()):
            if asked.get(name, 0.0) >= asleep.since:
                log.info("forgot %s, asleep (an unload was asked for)", name)
                self.asleep.pop(name)
        out = {}
        for name, held in list(self.held.items()):
            if not self._idle(name, held, now):
                continue
            asks = (asked.get(name, 0.0), sleeps.get(name, 0.0))
            found = verdict(held, now, self.keep_alive(name), asks, self.sleep_idle)
            if found is not None:
                out[name] = found
        return out

    @staticmethod
    def _had_its_turn(held: Held, now: float) -> bool:
        """A model loaded for requests is kept until one of them reached it, or for
        ``FIRST_REQUEST_S`` at most: with a keep-alive of 0 it was otherwise unloaded between its
        load and the waiting request's arrival (the API queues it once it sees the model up),
        and that request failed as one for a model no worker serves."""
        return held.served or now - held.loaded_at >= FIRST_REQUEST_S

    def unload(self, name: str, why: str, sleep: bool = False) -> None:
        """Stop the model's engine and give its memory back; ``sleep``: keep its place (listed
        as asleep here, woken here by its next request)."""
        from llmq.worker.runner.malloc_tuning import return_freed_memory

        held = self.held.pop(name)
        if sleep:
            self.asleep[name] = Asleep(held.entry, time.time())
        started = time.monotonic()
        held.loop.stop(0.0)
        held.thread.join(30)
        stopped = time.monotonic()
        loop = weakref.ref(held.loop)
        del held
        gc.collect()
        if loop() is not None:  # what holds it holds the model: its memory is not given back
            log.warning("unloaded %s, but its engine loop is still referenced", name)
        return_freed_memory()
        self.publish(time.time())
        log.info(
            "%s %s (%s) in %.2f s (%.2f s of it freeing its memory); %.0f MB held",
            "put to sleep" if sleep else "unloaded",
            name,
            why,
            time.monotonic() - started,
            time.monotonic() - stopped,
            self.held_bytes() / 2**20,
        )
        # A request queued as it unloaded: wished for again, so that a worker serves it.
        if self.client.xlen(self.keys.for_model(name).requests(name)) > 0:
            self.client.hsetnx(self.keys.wanted, name, json.dumps({"since": time.time()}))

    def _evictions(self, size: int) -> list[str] | None:
        """The idle models to unload (least recently used first) for ``size`` more bytes; None
        where the busy ones leave no room."""
        if not self.budget:
            return []
        free = self.budget - self.held_bytes()
        out: list[str] = []
        now = time.time()
        idle = [n for n, h in self.held.items() if self._idle(n, h, now)]
        for name in sorted(idle, key=lambda n: self.held[n].last_busy):
            if free >= size:
                break
            out.append(name)
            free += self.held[name].entry.size
        return out if free >= size else None

    def _evict_defer(self, victim: str, entry: Entry) -> float:
        """How long a wish waits before this worker evicts ``victim`` for ``entry``: not at all
        where no other worker has room for it without evicting, and ``victim`` is the fleet's
        least recently used idle model; else EVICT_DEFER_S (a worker with room loads it), or
        more (the worker holding an older idle model evicts that one first)."""
        mine, defer = self.held[victim].last_busy, 0.0
        for worker, record in fresh_residents(self.client.hgetall(self.keys.resident)).items():
            if worker == self.worker or record.get("loading"):
                continue
            budget = int(record.get("budget") or 0)
            if not budget or budget - int(record.get("held") or 0) >= entry.size:
                defer = max(defer, EVICT_DEFER_S)
            for other in record.get("models", {}).values():
                if not other.get("busy") and float(other.get("last_used", mine)) < mine:
                    defer = max(defer, EVICT_DEFER_S * 4)
        return defer

    # ---- loading -------------------------------------------------------------------------
    def _sleeps(self, model: str) -> bool:
        """Whether another worker has ``model`` asleep (the one to wake it)."""
        residents = fresh_residents(self.client.hgetall(self.keys.resident))
        return any(
            model in record.get("asleep", {})
            for worker, record in residents.items()
            if worker != self.worker
        )

    def _live(self, model: str) -> bool:
        """Whether a live engine (on any worker) serves ``model``."""
        for engine in self.client.zrange(self.keys.engines_index, 0, -1):
            served = self.client.hget(self.keys.engine(as_text(engine)), "model")
            if served is not None and as_text(served) == model:
                return True
        return False

    def _take(self, model: str, wish: dict, now: float) -> bool:
        """Load a wished-for model if this worker should; whether it tried."""
        if model in self.held or model not in self.catalogue:
            return False
        if float(wish.get("until") or now + 1) < now:  # its waiters are gone
            self.client.hdel(self.keys.wanted, model)
            return False
        if self._live(model):
            self.client.hdel(self.keys.wanted, model)
            return False
        entry = self.catalogue[model]
        first_seen = self.seen.setdefault(model, now)
        if model not in self.asleep and now - first_seen < WAKE_DEFER_S and self._sleeps(model):
            return False
        if self.budget and entry.size > self.budget:
            self._failed(
                model,
                f"it needs {entry.size / 2**20:.0f} MB, more than a worker's "
                f"budget (LLMQ_MODEL_MEMORY_MB) of {self.budget / 2**20:.0f} MB",
            )
            return True
        evict = self._evictions(entry.size)
        if evict is None or (evict and now - first_seen < self._evict_defer(evict[0], entry)):
            return False
        claim = self.keys.load_claim(model)
        if not self.client.set(claim, self.worker, nx=True, px=self.claim_ms):
            return False
        try:
            for name in evict:
                self.unload(name, f"evicted for {model}")
            self.load(entry)
        finally:
            if as_text(self.client.get(claim) or b"") == self.worker:
                self.client.delete(claim)
        return True

    def load(self, entry: Entry) -> None:
        """Load ``entry`` on a thread of its own (which then runs its engine loop), renewing the
        claim and the loading record while it loads."""
        from llmq.worker.runner.malloc_tuning import return_freed_memory
        from llmq.worker.service import build_engine_loop

        settings = self.settings.model_copy(
            update={"model": entry.source, "served_model_name": entry.name, "lora_modules": ""}
        )
        built, box = threading.Event(), {}

        def serve() -> None:
            try:
                box["loop"] = build_engine_loop(settings, f"{self.worker}/{entry.name}")
                warm_up(box["loop"].backend)
                return_freed_memory()  # the load's temporaries, kept by the raised thresholds
            except BaseException as exc:
                box["error"] = exc
                return
            finally:
                built.set()
            try:
                box["loop"].run()
            except BaseException:
                log.exception("the engine loop of %s crashed", entry.name)

        since = time.time()
        log.info("loading %s (%s, %.0f MB)", entry.name, entry.source, entry.size / 2**20)
        self.loading = entry.name
        thread = threading.Thread(target=serve, name=f"llmq-engine-{entry.name}", daemon=True)
        thread.start()
        while True:
            self._renew(entry, since)
            if built.wait(RENEW_S):
                break
        self.loading = None
        self.client.hdel(self.keys.loading, self.worker)
        if "error" in box:
            self.asleep.pop(entry.name, None)
            self._failed(entry.name, f"{type(box['error']).__name__}: {box['error']}")
            return
        self.held[entry.name] = Held(entry, box.pop("loop"), thread, time.time())
        woke = self.asleep.pop(entry.name, None) is not None
        self.client.hdel(self.keys.wanted, entry.name)
        self.client.hdel(self.keys.load_failed, entry.name)
        self.publish(time.time())
        log.info("%s %s in %.2f s", "woke" if woke else "loaded", entry.name, time.time() - since)

    def _renew(self, entry: Entry, since: float) -> None:
        record = {"model": entry.name, "source": entry.source, "since": since}
        record["until"] = time.time() + LOADING_VALID_S
        self.client.hset(self.keys.loading, self.worker, json.dumps(record))
        self.client.pexpire(self.keys.load_claim(entry.name), self.claim_ms)
        self.publish(time.time())

    def _failed(self, model: str, error: str) -> None:
        log.error("loading %s failed: %s", model, error)
        record = {"error": error, "at": time.time(), "worker": self.worker}
        self.client.hset(self.keys.load_failed, model, json.dumps(record))
        self.client.hdel(self.keys.wanted, model)


def verdict(
    held: Held, now: float, keep: float, asks: tuple[float, float], sleep_idle: float
) -> tuple[str, bool] | None:
    """Whether an idle model is unloaded (False) or put to sleep (True) now, and why: an unload
    asked for since its load, its keep-alive run out, a sleep asked for since its load, or
    ``sleep_idle`` seconds idle (0: never), in that order. ``asks``: when the latest unload and
    sleep were asked for (0: never)."""
    unload_at, sleep_at = asks
    idle_s, turn = now - held.last_busy, ModelManager._had_its_turn(held, now)
    if unload_at >= held.loaded_at:
        return "an unload was asked for", False
    if keep != FOREVER and idle_s >= keep and turn:
        return f"idle past its keep-alive of {keep:g} s", False
    if sleep_at >= held.loaded_at:
        return "a sleep was asked for", True
    if sleep_idle and idle_s >= sleep_idle and turn:
        return f"idle for {sleep_idle:g} s (LLMQ_SLEEP_IDLE_SECONDS)", True
    return None


def warm_up(backend) -> None:
    """One short generation before the model is announced: a first step's one-time costs
    belong to the load, not to the first request that waited for it (docs/performance.md,
    "Models on demand: the first request's wait")."""
    if backend.kind != "generate":
        return
    from llmq.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    started = time.monotonic()
    backend.engine.generate([[1, 2, 3]], params)
    log.info("load phase: first steps run in %.2f s", time.monotonic() - started)


def start_manager(settings: Settings, worker: str) -> ModelManager:
    manager = ModelManager(settings, worker)
    manager.start()
    return manager
