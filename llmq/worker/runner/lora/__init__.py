"""LoRA adapters in the forward: their weights loaded into slots (``lora_weights``,
``lora_slots``) and the per-row deltas of a step (``lora_linear``)."""
