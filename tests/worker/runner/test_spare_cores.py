"""SpareCores: what the rest of the machine leaves idle, its own process excluded."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from llmq.worker.runner.spare_cores import SpareCores

BURN = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass\n"


def test_a_busy_neighbour_takes_a_core_and_the_own_process_does_not():
    spare = SpareCores(cores=2, window_s=0.0)
    spare.spare()
    time.sleep(0.5)
    idle = spare.spare()  # what the rest of the machine leaves before this test adds load
    if idle < 1.5:
        pytest.skip(
            f"the machine is busy ({2 - idle:.1f} cores used by others): nothing to measure"
        )
    # This process busy for half a second: not counted against it.
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        pass
    own_busy = spare.spare()
    # Another process busy on one core: about one core fewer.
    burner = subprocess.Popen([sys.executable, "-c", BURN])
    try:
        time.sleep(0.3)
        spare.spare()
        time.sleep(0.8)
        neighbour_busy = spare.spare()
    finally:
        burner.wait()
    assert 0.0 <= neighbour_busy <= 2.0 and 0.0 <= own_busy <= 2.0
    assert own_busy >= idle - 0.5, (idle, own_busy)
    assert neighbour_busy <= 1.25, neighbour_busy
    assert own_busy - neighbour_busy >= 0.5, (own_busy, neighbour_busy)
