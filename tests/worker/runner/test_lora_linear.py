"""A projection wrapped for LoRA adds each adapter's delta to its own rows only, whatever the
base projection (float32, bfloat16 packed for oneDNN, int8, int4) and however the step's rows
fall: through torch's ops, gathered into slots (interleaved or in groups), in place (every row
in its slot's place), or run by run (one adapter, or groups too unequal to pad); and through
``kernels/lora_deltas.cpp``, with the slots in the model's dtype (a group of many rows through
its matmuls)."""

from __future__ import annotations

import pytest
import torch

from llmq.worker.runner import cpu_kernels
from llmq.worker.runner.linear.packed_linear import Linear, can_pack
from llmq.worker.runner.linear.quantized_linear import quantized_linear
from llmq.worker.runner.lora.lora_linear import LoraLinear, LoraState
from llmq.worker.runner.lora.lora_slots import LoraSlots, StepAdapters
from llmq.worker.runner.lora.lora_weights import AdapterWeights, BaseShape, Delta

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

K, ROWS = 64, 40
WIDTHS = {"q_proj": (64, K), "k_proj": (16, K), "v_proj": (16, K)}
COLUMNS = {"q_proj": 0, "k_proj": 64, "v_proj": 80}
N = 96
SHAPE = BaseShape(1, WIDTHS, frozenset(WIDTHS))
# slot -> (rank, scale, parts): ranks differ (padded in the slots), one without k.
ADAPTERS = [(8, 2.0, ("q_proj", "k_proj", "v_proj")), (16, 0.5, ("q_proj", "v_proj"))]
ADAPTERS.append((4, 1.5, ("q_proj", "k_proj", "v_proj")))


def _adapters(dtype) -> list[AdapterWeights]:
    g = torch.Generator().manual_seed(3)
    out = []
    for rank, scale, parts in ADAPTERS:
        deltas = {
            p: Delta(
                (torch.randn(rank, K, generator=g) * 0.3).to(dtype),
                (torch.randn(WIDTHS[p][0], rank, generator=g) * 0.3).to(dtype),
            )
            for p in parts
        }
        out.append(AdapterWeights(rank, scale, [deltas]))
    return out


def _bases(dtype):
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(N, K, generator=g) * 0.1).to(dtype)
    bias = (torch.randn(N, generator=g) * 0.1).to(dtype)
    yield "plain", Linear(weight, bias, "plain")
    if dtype == torch.bfloat16 and can_pack(weight):
        yield "onednn", Linear(weight, bias, "onednn")
    yield "int8", quantized_linear(weight, bias, 8)
    yield "int4", quantized_linear(weight, bias, 4)


# name -> (rows of slots 0, 1, 2; the path taken: gathered, in place or run by run)
GROUPINGS = {
    "interleaved": ([[0, 3, 4, 9], [1, 2, 7], [10, 30]], "gathered"),  # others: no adapter
    "groups": ([[0, 1, 2], [3, 4, 5, 6], [9, 10]], "gathered"),
    # 39 rows, each slot's 13 in its place: no gather, no scatter.
    "in_place": ([list(range(0, 13)), list(range(13, 26)), list(range(26, 39))], "in_place"),
    "one_adapter": ([list(range(ROWS))], "runs"),
    "prefill_beside_decodes": ([[0], [1], list(range(2, 40))], "runs"),
}


def _step(grouping: str, slots: LoraSlots) -> tuple[StepAdapters, list]:
    rows, _ = GROUPINGS[grouping]
    groups = list(enumerate(rows))
    num_rows = 39 if grouping == "in_place" else ROWS
    return StepAdapters(groups, slots, num_rows), groups


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_each_row_gets_its_own_adapter_s_delta(dtype, grouping, kernel):
    if kernel and not cpu_kernels.load():
        pytest.skip("llmq's CPU kernels are not built here")
    # float32 deltas through torch's ops on CPU; the model's dtype through the kernel
    slots = LoraSlots(SHAPE, 4, dtype if kernel else torch.float32, "cpu", kernel)
    adapters = _adapters(torch.float32)
    references = [[{p: (d.a, d.b) for p, d in a.layers[0].items()}, a.scale] for a in adapters]
    for slot, adapter in enumerate(adapters):
        slots.put(slot, adapter)
    step, groups = _step(grouping, slots)
    path = GROUPINGS[grouping][1]
    assert step.batched == (path != "runs")
    assert kernel or path == "runs" or step.identity == (path == "in_place")
    x = torch.randn(ROWS if grouping != "in_place" else 39, K).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for name, base in _bases(dtype):
        state = LoraState(SHAPE, slots)
        wrapped = LoraLinear(base, 0, "qkv", state)
        plain = base(x)
        assert torch.equal(wrapped(x), plain)  # no step: the base's output as it is
        with state.applying(step):
            y = wrapped(x)
        assert wrapped.out_features == N and wrapped.weight is base.weight
        expected = plain.float().clone()
        touched = set()
        for (_, rows), (deltas, scale) in zip(groups, references, strict=False):
            for part, (a, b) in deltas.items():
                col = COLUMNS[part]
                delta = (x[rows].float() @ a.t() @ b.t()) * scale
                expected[rows, col : col + b.shape[0]] += delta
            touched |= set(rows)
        others = [r for r in range(x.shape[0]) if r not in touched]
        assert torch.equal(y[others], plain[others]), name  # untouched, bit for bit
        assert (y.float() - expected).abs().max() <= tolerance * expected.abs().max(), name


def test_a_projection_no_adapter_targets_adds_nothing():
    slots = LoraSlots(SHAPE, 2, torch.float32, "cpu")
    slots.put(0, _adapters(torch.float32)[0])
    state = LoraState(SHAPE, slots)
    base = Linear(torch.randn(K, K), None, "plain")
    wrapped = LoraLinear(base, 0, "o", state)  # no adapter targets o_proj: no slots for it
    x = torch.randn(ROWS, K)
    with state.applying(StepAdapters([(0, [0, 2]), (1, [1])], slots, ROWS)):
        assert torch.equal(wrapped(x), base(x))
    assert state.step is None  # the step's adapters end with it
