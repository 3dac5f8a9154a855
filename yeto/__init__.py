"""yeto: LoRA fine-tuning across independent islands, DiLoCo-style."""

__version__ = "0.1.0"


class YetoError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits 2."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`: what a foreign error (SkyPilot's, the hub's, a store's, often many lines
    of hints and tracebacks) adds to a one-line error of ours."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:limit]}" if lines and lines[0] else type(e).__name__
