"""The torch + peft island: one process or a torchrun group, micro-batches, generate, export."""
