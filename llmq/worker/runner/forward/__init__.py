"""The model's forward: llmq's decoder loop (``decoder_forward``, ``decoder_layers``, per family
``decoder_families``), the fused C++ step (``decoder_cpp_step``), CUDA graphs, the compiled CPU
step, mixture-of-experts layers, and what a model asks of them (``model_support``)."""
