"""yeto: LoRA fine-tuning across independent islands, DiLoCo-style."""

from typing import Any

__version__ = "0.1.0"


class YetoError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits 2."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`: what a foreign error (SkyPilot's, the hub's, a store's, often many lines
    of hints and tracebacks) adds to a one-line error of ours."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:limit]}" if lines and lines[0] else type(e).__name__


TORCH_EXTRA = "pip install 'yeto[torch]'"
TORCH_MODULES = ("torch", "peft")  # the torch island's extra; the syncer, CLI, launch and MLX island need neither


def missing_module(names: tuple[str, ...]) -> str | None:
    """The first of `names` this install cannot import (None when it has them all), without importing any."""
    import importlib.util
    import sys

    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ValueError:  # in sys.modules without a spec: blocked (None) or a stand-in
            if sys.modules.get(name) is None:
                return name
    return None


def missing_torch() -> str | None:
    """The first of the torch extra's modules this install cannot import (None when it has them all)."""
    return missing_module(TORCH_MODULES)


def require_torch(what: str) -> None:
    """One line, not an import traceback, where a torch-only part runs on an install without the torch extra."""
    missing = missing_torch()
    if missing is not None:
        raise YetoError(f"{what} runs on torch and this install has no {missing}: {TORCH_EXTRA} (or, on a Mac, "
                        "train on MLX: pip install 'yeto[mlx]', then yeto train --backend mlx)")


OLD_WORD, WORD = "learner", "island"  # the old spelling of an island (files written before the rename say it)


def in_current_words(record: Any) -> Any:
    """`record` (a tape event, a saved config, a registry) with each key, at any depth, that says the old word for
    an island saying "island" instead, so files written before the rename read as written today."""
    if isinstance(record, dict):
        return {k.replace(OLD_WORD, WORD) if isinstance(k, str) else k: in_current_words(v) for k, v in record.items()}
    if isinstance(record, list):
        return [in_current_words(v) for v in record]
    return record
