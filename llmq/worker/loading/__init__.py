"""Model loading for the worker: checkpoints, GGUF files, quantized checkpoints, encoders."""
