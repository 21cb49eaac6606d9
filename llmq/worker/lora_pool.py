"""The LoRA adapters a worker holds: at most ``max_loras`` loaded, read from disk on a
background thread while the other requests' steps go on.

A sequence that names an adapter counts as its user from its arrival to its end. It enters the
scheduler once its adapter is loaded (at once if it is): until then it waits here, as a
sequence waits for its grammar's matcher. To load an adapter into a full pool the least recently
used adapter that no sequence uses is dropped; where every loaded one is in use, the load (and
its sequences) wait for one to be freed. A load that fails fails its waiting sequences alone.
An adapter is keyed by its name and folder: the same name from another folder is another one.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from llmq.common.placement.block_hashes import adapter_root
from llmq.worker.engine.sequence import LoraRef, Sequence
from llmq.worker.request_error import RequestError
from llmq.worker.runner.lora import lora_linear
from llmq.worker.runner.lora.lora_slots import LoraSlots
from llmq.worker.runner.lora.lora_weights import AdapterWeights, LoraLoadError, load_adapter

log = logging.getLogger(__name__)


class LoraPool:
    def __init__(
        self,
        load: Callable[[LoraRef], AdapterWeights],
        max_loras: int,
        slots: LoraSlots | None = None,
    ):
        """``load``: reads an adapter (on the pool's thread); raises LoraLoadError for one that
        cannot be served. ``slots``: where loaded adapters' weights are written (one slot
        each; None: kept as loaded)."""
        self._load = load
        self.max_loras = max_loras
        self.slots = slots
        self._free_slots = set(range(max_loras))
        self.resident: OrderedDict[LoraRef, AdapterWeights] = OrderedDict()  # least recent first
        self.pending: dict[str, Sequence] = {}  # request id -> a sequence waiting for its adapter
        self._users: Counter[LoraRef] = Counter()
        self._loading: dict[LoraRef, Future[AdapterWeights]] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self.num_loads = 0
        self._folders: dict[str, str] = {}  # adapter name -> the first folder seen under it

    @classmethod
    def for_runner(cls, runner, config) -> LoraPool:
        """The pool of ``runner``'s model (``config``: the engine's, for ``max_loras`` and
        ``max_lora_rank``), its projections wrapped to apply adapters; RequestError for a model
        llmq does not apply adapters to."""
        max_loras, max_rank = config.max_loras, config.max_lora_rank
        if runner.forward is None:
            raise RequestError(
                "LoRA adapters need llmq's fast forward, which does not serve this model"
            )
        # The model's dtype, but float32 on CPU without llmq's kernels (lora_slots.py says why).
        torch_ops_on_cpu = runner.device.type == "cpu" and not runner.forward.small_step_ops
        dtype = torch.float32 if torch_ops_on_cpu else runner.dtype
        try:
            state = lora_linear.install(runner.forward, max_loras, dtype)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

        def load(ref: LoraRef) -> AdapterWeights:
            return load_adapter(ref.path, state.shape, max_rank, dtype, runner.device)

        return cls(load, max_loras, state.slots)

    # ---- sequences -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> bool:
        """Count ``seq`` as a user of its adapter. True: the adapter is loaded (the sequence may
        run now); False: it waits, and :meth:`ready` hands it back."""
        ref = seq.lora
        self._users[ref] += 1
        if ref in self.resident:
            self.resident.move_to_end(ref)
            return True
        self.pending[seq.request_id] = seq
        self._start_loads()
        return False

    def release(self, seq: Sequence) -> bool:
        """``seq`` ended (finished, failed or aborted); whether it was still waiting here."""
        waiting = self.pending.pop(seq.request_id, None) is not None
        ref = seq.lora
        self._users[ref] -= 1
        if self._users[ref] <= 0:
            del self._users[ref]
        return waiting

    def ready(self) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """The waiting sequences whose adapter is now loaded, and those whose adapter failed to
        load, with the error; loads that waited for room start."""
        ready: list[Sequence] = []
        failed: list[tuple[Sequence, str]] = []
        for ref, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[ref]
            error = self._finish_load(ref, future)
            for rid, seq in list(self.pending.items()):
                if seq.lora == ref:
                    del self.pending[rid]
                    if error is None:
                        ready.append(seq)
                    else:
                        failed.append((seq, error))
        self._start_loads()
        return ready, failed

    def _finish_load(self, ref: LoraRef, future: Future[AdapterWeights]) -> str | None:
        """Keep a finished load's adapter; the error that failed it, if any."""
        try:
            adapter = future.result()
        except LoraLoadError as exc:
            return f"LoRA adapter {ref.name!r} could not be loaded: {exc}"
        except Exception as exc:  # a bug or an odd file: this adapter's requests only
            log.exception("loading LoRA adapter %s from %s failed", ref.name, ref.path)
            return f"LoRA adapter {ref.name!r} could not be loaded: {exc!r}"
        # Its room was kept when the load started. The lowest free slot: a step's batched
        # deltas run over the slots up to its highest.
        slot = min(self._free_slots)
        self._free_slots.discard(slot)
        if self.slots is not None:
            self.slots.put(slot, adapter)  # a copy into the stacked weights, on this thread
        adapter.slot = slot
        self.resident[ref] = adapter
        self.num_loads += 1
        log.info("LoRA adapter %s loaded from %s", ref.name, ref.path)
        return None

    def _start_loads(self) -> None:
        """Start loading the adapters waiting sequences need, while there is room (or an unused
        adapter to drop)."""
        for seq in list(self.pending.values()):
            ref = seq.lora
            if ref in self.resident or ref in self._loading:
                continue
            if len(self.resident) + len(self._loading) >= self.max_loras and not self._evict():
                return  # every loaded adapter is in use: wait for one to be freed
            self._loading[ref] = self._executor.submit(self._load, ref)

    def _evict(self) -> bool:
        """Drop the least recently used adapter no sequence uses; whether there was one."""
        for ref in self.resident:
            if not self._users.get(ref):
                self._free_slots.add(self.resident.pop(ref).slot)
                log.info("LoRA adapter %s unloaded (least recently used)", ref.name)
                return True
        return False

    def hash_root(self, ref: LoraRef) -> int:
        """The root of the prefix-cache chain of ``ref``'s sequences: ``adapter_root`` of its
        name, as the API computes it for placement, for the first folder this worker saw under
        that name; another folder under the same name (an adapter replaced) chains from a root
        of its own, so that it never takes the blocks of the one it replaced."""
        first = self._folders.setdefault(ref.name, ref.path)
        return adapter_root(ref.name if first == ref.path else f"{ref.name}\0{ref.path}")

    # ---- the engine's view ---------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether sequences wait for an adapter."""
        return bool(self.pending)

    @property
    def loading(self) -> bool:
        """Whether an adapter is being read."""
        return bool(self._loading)

    def wait(self, timeout: float) -> None:
        """Block until a load finishes or ``timeout`` seconds pass."""
        wait(list(self._loading.values()), timeout, FIRST_COMPLETED)

    def names(self) -> str:
        """The loaded adapters' names, comma-separated (the heartbeat's ``loras``)."""
        return ",".join(sorted({ref.name for ref in self.resident}))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
