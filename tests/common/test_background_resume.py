"""A background response's re-run after a crash: its events joined to those its first run
stored read as one uninterrupted stream, whatever the chunks of each run."""

from __future__ import annotations

import pytest

from llmq.worker.background import Resumed, item_ids

pytestmark = pytest.mark.unit


def stream(deltas: list[str]) -> list[dict]:
    """The events of one run whose text came in ``deltas``."""
    item = item_ids("resp_" + "0" * 32)("msg", 0)
    events = [{"type": "response.created"}, {"type": "response.in_progress"}]
    events.append({"type": "response.output_item.added", "output_index": 0, "item": {"id": item}})
    events.append({"type": "response.content_part.added", "output_index": 0, "item_id": item})
    for d in deltas:
        events.append(
            {"type": "response.output_text.delta", "output_index": 0, "item_id": item, "delta": d}
        )
    text = "".join(deltas)
    events.append({"type": "response.output_text.done", "output_index": 0, "text": text})
    events.append({"type": "response.output_item.done", "output_index": 0})
    events.append({"type": "response.completed"})
    return [{**e, "sequence_number": i} for i, e in enumerate(events)]


@pytest.mark.parametrize("cut", [3, 4, 5, 6, 7])
def test_a_rerun_with_other_chunks_continues_the_stored_stream(cut):
    first = stream(["Hel", "lo, wor", "ld"])[:cut]  # the first run died after ``cut`` events
    resumed = Resumed(first)
    rest = [e for e in (resumed.next(e) for e in stream(["H", "ello", ", world"])) if e]
    joined = first + rest
    assert [e["sequence_number"] for e in joined] == list(range(len(joined)))
    kinds = [e["type"] for e in joined]
    assert kinds.count("response.created") == 1 and kinds.count("response.completed") == 1
    assert kinds.count("response.output_item.added") == 1
    deltas = [e["delta"] for e in joined if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "Hello, world" and all(deltas)
    assert len({e["item_id"] for e in joined if "item_id" in e}) == 1


def test_item_ids_follow_the_response_and_index():
    ids = item_ids("resp_" + "1" * 32)
    assert ids("msg", 0) == item_ids("resp_" + "1" * 32)("msg", 0)
    assert ids("msg", 0) != ids("msg", 1) and ids("fc", 1).startswith("fc_")
    assert ids("msg", 0) != item_ids("resp_" + "2" * 32)("msg", 0)
