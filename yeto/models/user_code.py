"""A function the user names on the command line (`package.module:function` or `path/to/file.py:function`), loaded
the same way wherever yeto takes one: a custom loss (`--loss-function`), a custom scorer (`yeto eval --scorer`)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Callable

from yeto import YetoError


def _import_file(path: str, prefix: str) -> Any:
    """A module given as a file: imported under its own name, from where it is (no sys.path change)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ImportError(f"no file {file}")
    spec = importlib.util.spec_from_file_location(f"{prefix}{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_user_function(spec: str, flag: str) -> Callable[..., Any]:
    """`spec`'s function; a spec that is not `module:function`, a module that does not import or a name that is not
    callable is a one-line error naming `flag`."""
    if ":" not in spec:
        raise YetoError(f"{flag} {spec!r}: give 'package.module:function' or 'path/to/file.py:function'")
    mod_name, fn_name = spec.rsplit(":", 1)
    try:
        mod = (_import_file(mod_name, f"yeto_user_{flag.strip('-').replace('-', '_')}_") if mod_name.endswith(".py")
               else importlib.import_module(mod_name))
    except (ImportError, OSError, SyntaxError) as e:
        raise YetoError(f"{flag} {spec!r}: cannot import module {mod_name!r} ({type(e).__name__}: {e})") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise YetoError(f"{flag} {spec!r}: module {mod_name!r} has no callable {fn_name!r}")
    return fn
