"""`python -m yeto.backends.torch` (and `torchrun ... -m yeto.backends.torch`): the torch island, as
`yeto train --backend torch`."""

from yeto.cli.train_command import train_command
from yeto.cli.usage import run_typer

run_typer(train_command("torch"))
