"""Quantized checkpoints as they are published: compressed-tensors, GPTQ, AWQ and fp8, read
from their safetensors files into one form each for integer and float8 weights
(``quant_tensor.QuantTensor``, ``fp8_tensor.Fp8Tensor``)."""
