"""yeto: LoRA fine-tuning across independent islands, DiLoCo-style."""

__version__ = "0.1.0"


class YetoError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits 2."""
