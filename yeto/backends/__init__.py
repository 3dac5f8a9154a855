"""The tensor backends, peers that never import each other: torch (+ peft) and MLX."""
