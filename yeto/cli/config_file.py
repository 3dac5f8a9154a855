"""`--config run.yaml`: a command's flags from a YAML file, one per run as axolotl's and torchtune's users keep them,
and `--print-config`, which writes the flags a command would run with as a file `--config` reads back.

Each key is a flag's long name without its dashes: `seq-len: 128` is the canonical spelling (`--print-config`
writes it), `seq_len: 128` is read the same. The file only sets click's defaults (`default_map`), so a flag given on
the command line wins and click still checks every value's type. `yeto launch` also takes the flags it passes on (the
syncer's and the islands'), which go to them as if given after it.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Optional

import typer

from yeto import YetoError
from yeto.cli.usage import running_click, usage_errors

CONFIG_HELP = ("A YAML file of flags by their long names (seq-len: 128, or seq_len); a flag on the command line "
               "wins.")
PRINT_CONFIG_HELP = "Print the flags this command would run with as YAML (what --config reads back), and exit."
CONFIG_PARAMS = ("config", "print_config")  # the parameters `with_config_file` adds: no keys of the file
PASSED_ON = "yeto.config.passed_on"  # ctx.meta: the file's flags for the commands `yeto launch` passes flags to
CLOSE_ENOUGH = 0.6  # difflib's ratio above which a known key is offered as the one meant


def read_config(path: str) -> dict[str, Any]:
    """The YAML mapping in `path`, refused in one line when it is missing, does not parse or is not a mapping of
    names to values."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise YetoError(f"--config {path}: no such file; give a YAML file of flags (yeto train --print-config "
                        "writes one)")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise YetoError(f"--config {path} is not valid YAML{line} ({problem}): fix it, or write a fresh one with "
                        "--print-config") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise YetoError(f"--config {path} holds a {type(data).__name__}, not a mapping: write one flag per line, "
                        "as `seq-len: 128`")
    for key, value in data.items():
        if not isinstance(key, str) or isinstance(value, (dict, list)):
            raise YetoError(f"--config {path}: {key!r} is not `flag-name: value` (one value per flag, no nesting)")
    return data


def key_of(name: str) -> str:
    """The canonical key for a flag name or a key as written: `--seq-len`, `seq_len` -> `seq-len`."""
    return name.lstrip("-").replace("_", "-")


def options_by_key(command: Any) -> dict[str, Any]:
    """Every option of the click `command` by key (each long name, hidden ones included; not `--no-x`, whose value
    reads backwards), less --config and --print-config themselves."""
    keys: dict[str, Any] = {}
    for param in command.params:
        if param.param_type_name != "option" or param.name in CONFIG_PARAMS:
            continue
        for opt in param.opts:
            if opt.startswith("--"):
                keys[key_of(opt)] = param
    return keys


def unknown_key(path: str, key: str, known: Iterable[str], prog: str) -> YetoError:
    """The one line for a key no flag has, naming the closest one."""
    close = difflib.get_close_matches(key_of(key), sorted(known), n=1, cutoff=CLOSE_ENOUGH)
    meant = f" (did you mean {close[0]!r}?)" if close else ""
    return YetoError(f"--config {path}: unknown key {key!r}{meant}: the keys are {prog}'s flags by their long names "
                     f"(`{prog} --help`)")


def coerce(option: Any, ctx: Any, value: Any) -> Any:
    """`value` as the option's type (None stays None), checked as click checks a flag's value: a usage error when it
    is not one. (typer's bundled click coerces through the option's runtime parameter; click through its type.)"""
    if value is None:
        return None
    runtime = getattr(option, "get_runtime_param", None)
    if runtime is not None:
        return runtime().coerce(value, param=option, ctx=ctx)
    return option.type_cast_value(ctx, value)


def as_args(option: Any, value: Any) -> list[str]:
    """The command-line flags that give `option` the config file's `value` (none for an unset value or an off
    switch that has no `--no-` twin)."""
    if value is None:
        return []
    flag = next(o for o in option.opts if o.startswith("--"))
    if option.is_flag:
        if value:
            return [flag]
        return [option.secondary_opts[0]] if option.secondary_opts else []
    return [flag, str(value)]


def _use_config(passed_on: Callable[[], list[tuple[str, Any]]], ctx: typer.Context, value: Optional[str]
                ) -> Optional[str]:
    """--config's callback (eager: before any other flag is read): the file's values become the command's defaults,
    and those of the commands `passed_on` names wait in ctx.meta for `passed_on_args`."""
    if value is None or ctx.resilient_parsing:
        return value
    prog = ctx.command_path
    own = options_by_key(ctx.command)
    others = [(name, options_by_key(command)) for name, command in passed_on()]
    defaults, later = dict(ctx.default_map or {}), []
    for key, v in read_config(value).items():
        canonical = key_of(key)
        option = next((options[canonical] for options in (own, *(o for _, o in others)) if canonical in options),
                      None)
        if option is None:
            shown = [k for options in (own, *(o for _, o in others)) for k, o in options.items() if not o.hidden]
            raise unknown_key(value, key, shown, prog)
        try:
            coerce(option, ctx, v)  # (click's check of the value, here where the file can be named)
        except usage_errors() as e:
            raise YetoError(f"--config {value}: {key}: {' '.join(e.format_message().split())}") from None
        if canonical in own:
            defaults[option.name] = v
        else:
            later.append((option, v))
    ctx.default_map = defaults
    ctx.meta[PASSED_ON] = later
    return value


def passed_on_args(ctx: Any) -> list[str]:
    """The config file's flags for the commands `yeto launch` passes flags to, less those given on its command line
    (any spelling of the same flag there wins)."""
    given = {a.split("=", 1)[0] for a in ctx.args if a.startswith("--")}
    args: list[str] = []
    for option, value in ctx.meta.get(PASSED_ON, []):
        if not given & {*option.opts, *option.secondary_opts}:
            args += as_args(option, value)
    return args


def config_yaml(ctx: Any, values: dict[str, Any], header: str) -> str:
    """`values` (a command's parameters) as the YAML --config reads: every option the command shows in --help, by its
    canonical key, in --help's order."""
    import yaml

    shown = {}
    for param in ctx.command.params:
        if (param.param_type_name == "option" and not param.hidden and param.name in values
                and param.name not in CONFIG_PARAMS):
            shown[key_of(next(o for o in param.opts if o.startswith("--")))] = values[param.name]
    return f"# {header}\n" + yaml.safe_dump(shown, sort_keys=False, default_flow_style=False)


def current_context() -> Any:
    """The click context of the command running (typer's bundled click's, where typer bundles one)."""
    return running_click().globals.get_current_context()


Settle = Callable[[dict[str, Any]], dict[str, Any]]  # a command's values, with the choices between flags made


def with_config_file(command: Callable[..., Any], passed_on: Callable[[], list[tuple[str, Any]]] = list,
                     settle: Settle = dict) -> Callable[..., Any]:
    """`command` with --config FILE (its flags' defaults from FILE) and --print-config (write the flags it would run
    with, and exit). `passed_on()`: the (name, click command) pairs whose flags the file may hold too (`yeto
    launch`'s syncer and islands: the command takes them as ctx.args and adds `passed_on_args(ctx)`). `settle`
    makes the choices between flags (a command-line flag winning over the file's other choice) before the command
    runs or prints them, so that what is printed reads back the same. Apply it inside `with_old_spellings`, so that
    --print-config shows an old spelling's value under the new flag."""
    signature = inspect.signature(command, eval_str=True)

    def callback(ctx: typer.Context, value: Optional[str]) -> Optional[str]:
        return _use_config(passed_on, ctx, value)

    extra = [
        inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
            Optional[str], typer.Option(help=CONFIG_HELP, is_eager=True, callback=callback)]),
        inspect.Parameter("print_config", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
            bool, typer.Option("--print-config", help=PRINT_CONFIG_HELP, show_default=False)]),
    ]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        kwargs.pop("config")
        printing = kwargs.pop("print_config")
        kwargs = settle(kwargs)
        if printing:
            ctx = current_context()
            text = config_yaml(ctx, {k: v for k, v in kwargs.items() if k != "ctx"},
                               f"{ctx.command_path} --config FILE reads this back")
            if "ctx" in kwargs:  # (a command that passes flags on: theirs too, the file's and the command line's)
                text += passed_on_yaml(passed_on_args(ctx) + list(ctx.args), passed_on())
            typer.echo(text, nl=False)
            raise typer.Exit(0)
        return command(**kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *extra])  # type: ignore
    return wrapper


def passed_on_yaml(args: list[str], commands: list[tuple[str, Any]]) -> str:
    """The flags a command passes on (`args`, as given after it) as YAML, each value read by the first of
    `commands` that takes the flag (a later value of a flag wins, as on the command line)."""
    import yaml

    found: dict[str, Any] = {}
    i = 0
    while i < len(args):
        name, eq, inline = args[i].partition("=")
        option = next((o for _, command in commands for o in command.params if o.param_type_name == "option"
                       and name in (*o.opts, *o.secondary_opts)), None)
        if option is None or not name.startswith("--"):
            raise YetoError(f"{args[i]}: no command this one passes flags to takes it (see their --help)")
        key = key_of(next(o for o in option.opts if o.startswith("--")))
        if option.is_flag:
            found[key], i = name in option.opts, i + 1
            continue
        if not eq and i + 1 >= len(args):
            raise YetoError(f"{name} needs a value")
        raw, i = (inline, i + 1) if eq else (args[i + 1], i + 2)
        found[key] = coerce(option, None, raw)
    return yaml.safe_dump(found, sort_keys=False, default_flow_style=False) if found else ""
