"""Which dtype `auto` picks: float16 on CUDA, bfloat16 only on CPUs that multiply it in
hardware (elsewhere oneDNN emulates it, several times slower than float32)."""

import pytest
import torch

from llmq.worker.loading.model_loader import cpu_has_native_bfloat16, resolve_dtype

pytestmark = pytest.mark.unit

ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi2\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 avx512vl\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f amx_tile amx_bf16 amx_int8\n"
SKYLAKE_X = "flags\t\t: avx2 avx512f avx512bw avx512vl\n"
NEOVERSE_V1 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
NEOVERSE_N1 = "processor\t: 0\nFeatures\t: fp asimd aes crc32 atomics\n"


def test_native_bfloat16_read_from_the_cpu_flags():
    assert cpu_has_native_bfloat16(ZEN4)
    assert cpu_has_native_bfloat16(SAPPHIRE_RAPIDS)
    assert cpu_has_native_bfloat16(NEOVERSE_V1)
    assert not cpu_has_native_bfloat16(ZEN3)
    assert not cpu_has_native_bfloat16(SKYLAKE_X)
    assert not cpu_has_native_bfloat16(NEOVERSE_N1)
    assert not cpu_has_native_bfloat16("")


def test_auto_dtype_follows_the_hardware():
    assert resolve_dtype("auto", "cuda") == torch.float16
    native = cpu_has_native_bfloat16()
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float32", "cuda") == torch.float32
