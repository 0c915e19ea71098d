"""Training layer (arguments, loop, checkpointing) on top of pip's megatron.core."""
