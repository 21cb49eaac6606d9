"""Quantized checkpoints as they are published: compressed-tensors, GPTQ and AWQ, read from
their safetensors files into one form (``quant_tensor.QuantTensor``)."""
