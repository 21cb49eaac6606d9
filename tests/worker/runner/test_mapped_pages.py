"""Releasing a weight file's pages once copied: only file pages go, their values stay readable,
and a page written since it was mapped is kept."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmq.worker.runner.loaders import mapped_pages

pytestmark = pytest.mark.unit

MIB = 1 << 20


def _rss_file_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.fixture
def mapped(tmp_path):
    """A 16 MiB bfloat16 weight read from a safetensors file (a view of its mapping), and the
    values it holds."""
    weight = torch.randn(2048, 4096).to(torch.bfloat16)
    save_file({"w": weight}, tmp_path / "w.safetensors")
    loaded = load_file(tmp_path / "w.safetensors")["w"]
    return loaded, weight


def test_a_mapped_weight_leaves_the_resident_set_and_reads_back_the_same(mapped):
    loaded, weight = mapped
    assert torch.equal(loaded, weight)  # every page read: resident
    before = _rss_file_kib()
    released = mapped_pages.release(loaded)
    assert released >= 15 * MIB  # all but the partial pages at its two ends
    assert before - _rss_file_kib() >= 15 * 1024
    assert torch.equal(loaded, weight)  # faulted in again from the file


def test_anonymous_memory_is_never_released():
    weight = torch.randn(1024, 4096)
    copy = weight.clone()
    assert mapped_pages.release(weight) == 0
    assert torch.equal(weight, copy)


def test_a_page_written_since_mapping_keeps_the_whole_range(mapped):
    loaded, _ = mapped
    start = loaded.data_ptr()
    assert mapped_pages._file_mapping_of(start) is not None  # a view of the file
    loaded[1000, 7] = 123.0  # copied on write: that page is no longer the file's
    assert mapped_pages.release(loaded) == 0
    assert loaded[1000, 7].item() == 123.0


def test_a_pass_with_the_hooks_releases_each_module_as_it_runs(tmp_path):
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)))
    model.to(torch.bfloat16)
    save_file(model.state_dict(), tmp_path / "m.safetensors")
    model.load_state_dict(load_file(tmp_path / "m.safetensors"), assign=True)
    x = torch.randn(1, 1024, dtype=torch.bfloat16)
    expected = model(x)
    hooks = mapped_pages.released_as_run(model)
    before = _rss_file_kib()
    try:
        assert torch.equal(model(x), expected)
    finally:
        for hook in hooks:
            hook.remove()
    assert before - _rss_file_kib() >= 3 * 2 * 1024  # 2 MiB a layer, less partial pages
    assert torch.equal(model(x), expected)
