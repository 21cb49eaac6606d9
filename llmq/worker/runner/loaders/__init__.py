"""Weights read per file format onto the linear layers: a GGUF file's blocks (``gguf_weights``,
``gguf_blocks``), a quantized checkpoint's tensors (``checkpoint_weights``), and a weight file's
pages released once copied (``mapped_pages``)."""
