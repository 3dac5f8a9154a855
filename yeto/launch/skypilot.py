"""SkyPilot itself: imported where a cloud is used, with a one-line error where it is missing or too old."""

from __future__ import annotations

from typing import Any

from yeto import YetoError

MIN_SKYPILOT = (0, 10)  # the request-based client SDK (sky.get / sky.stream_and_get)


def import_sky() -> Any:
    """SkyPilot, or a one-line error naming the fix."""
    try:
        import sky
    except ImportError as e:
        raise YetoError("cloud launch needs SkyPilot: pip install 'yeto[launch]' (then `sky check` to see which "
                        "clouds your credentials reach)") from e
    version = tuple(int(p) for p in sky.__version__.split(".")[:2] if p.isdigit())
    if version and version < MIN_SKYPILOT and not sky.__version__.startswith("1.0.0.dev"):
        raise YetoError(f"SkyPilot {sky.__version__} is too old: yeto needs 0.10 or newer (pip install -U skypilot)")
    return sky
