"""Fixtures of the worker's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def lora_cases(model_dir, tmp_path_factory):
    """lora_cases(arch) -> the LoRA case of the tiny model of ``arch`` (``lora_cases.py``:
    adapters and PEFT's references), built once per session."""
    from tests.worker.lora_cases import lora_case

    built = {}

    def get(arch: str):
        if arch not in built:
            built[arch] = lora_case(model_dir(arch), tmp_path_factory.mktemp(f"lora-{arch}"))
        return built[arch]

    return get
