"""`python -m yeto.backends.torch` (and `torchrun ... -m yeto.backends.torch`): the torch island, as `yeto train`."""

from yeto.cli.train import torch_train_command
from yeto.cli.usage import run_typer

run_typer(torch_train_command())
