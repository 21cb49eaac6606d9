"""Speculative decoding: proposers guess a sequence's next tokens, the target model checks them
all in one step, the engine keeps those it agrees with (``engine.md``'s speculation section)."""
