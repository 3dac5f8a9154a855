"""`python -m yeto.launch`: the head of a cloud run (syncer + fleet controller), as `yeto launch` starts it."""

from yeto.cli.head_command import head_command
from yeto.cli.usage import run_typer

run_typer(head_command)
