"""`python -m yeto.backends.mlx`: the MLX island, as `yeto train --backend mlx` (on Linux re-executed with a fast BLAS
first)."""

from yeto.backends.mlx.compat import reexec_with_fast_blas

reexec_with_fast_blas()

from yeto.cli.train_command import train_command  # noqa: E402  (after the re-exec: nothing heavy loads twice)
from yeto.cli.usage import run_typer  # noqa: E402

run_typer(train_command("mlx"))
