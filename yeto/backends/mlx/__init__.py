"""The MLX island: the same adapter (peft names, shapes, scaling), data and loss on Apple's
tensor engine (and on MLX's CPU backend on Linux)."""
