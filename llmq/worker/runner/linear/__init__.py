"""Linear layers and quantization: packed bfloat16 weights, int8/int6/int4 weights on llmq's
kernels or torch's, W8A8 and fp8 on CUDA, and the plans that quantize a model as its forward is
built (``quantize``)."""
