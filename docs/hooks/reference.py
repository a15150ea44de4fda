"""The manual's generated references, made at every build so they cannot go stale: the command
line, walked from the root Typer app (`prefect_gpu_budget.cli.app`), and the blocks, read from
the pydantic fields of each public name of `prefect_gpu_budget.blocks`.

An MkDocs hook (`hooks:` in mkdocs.yml): `on_files` adds `reference/cli.md` and
`reference/blocks.md` as generated pages before the nav is built, so the nav may list them.
"""

from __future__ import annotations

import enum
import html
import inspect
import re
import typing
from collections.abc import Iterator

import click
from mkdocs.structure.files import File, Files

PROG = "prefect-gpu-budget"


def on_files(files: Files, config) -> Files:
    for path, content in (("reference/cli.md", cli_page()), ("reference/blocks.md", blocks_page())):
        files.append(File.generated(config, path, content=content))
    return files


# 1. the command line


def cli_page() -> str:
    """Every command of the root app, in the order `--help` lists them: its help, its usage,
    its arguments and its options with their defaults."""
    import typer

    from prefect_gpu_budget.cli import app

    root = typer.main.get_command(app)
    parts = [
        "# Command line reference\n",
        f"Generated from the commands themselves when the manual is built: `{PROG} COMMAND "
        "--help` prints the same.\n",
    ]
    for path, command, ctx in _walk(root, [PROG], None):
        parts.append(_command_section(path, command, ctx))
    return "\n".join(parts)


def _walk(
    command: click.Command, path: list[str], parent: click.Context | None
) -> Iterator[tuple[list[str], click.Command, click.Context]]:
    ctx = click.Context(command, info_name=path[-1], parent=parent)
    yield path, command, ctx
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None:  # hidden ones too: `agents serve` is the gateway
                yield from _walk(sub, [*path, name], ctx)


def _command_section(path: list[str], command: click.Command, ctx: click.Context) -> str:
    level = "#" * min(len(path) + 0, 4)
    lines = [f"{level} `{' '.join(path)}`\n"]
    if command.hidden:
        lines.append("Not listed by `--help`.\n")
    if command.help:
        lines.append(_text(inspect.cleandoc(command.help)) + "\n")
    usage = " ".join(command.collect_usage_pieces(ctx))
    lines.append(f"```text\nUsage: {' '.join(path)} {usage}\n```\n")
    if isinstance(command, click.Group):
        subs = command.list_commands(ctx)
        lines.append("Commands: " + ", ".join(f"`{n}`" for n in subs) + ".\n")
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    options = [p for p in command.params if isinstance(p, click.Option) and not p.hidden]
    if arguments:
        lines.append("Arguments:\n")
        lines.extend(_param(p) for p in arguments)
        lines.append("")
    if options:
        lines.append("Options:\n")
        lines.extend(_param(p) for p in options)
        lines.append("")
    return "\n".join(lines)


def _param(param: click.Parameter) -> str:
    if isinstance(param, click.Argument):
        name = (param.metavar or param.name or "").upper()
        head = f"`{name}`"
        if not param.required:
            head += " (optional)"
    else:
        names = [*param.opts, *param.secondary_opts]
        kind = "" if param.is_flag else f" {param.type.name.upper()}"
        head = "`" + " / ".join(names) + kind + "`"
        if param.required:
            head += " (required)"
    said = _text(getattr(param, "help", None) or "")
    default = _default(param)
    if default is not None:
        said = f"{said} Default: `{default}`.".strip()
    return f"- {head}: {said}" if said else f"- {head}"


def _default(param: click.Parameter) -> str | None:
    """The default as `--help` would show it; None where there is none worth saying (unset,
    computed, empty, or a lone flag's False)."""
    default = param.default
    if default is None or callable(default) or default in ((), []):
        return None
    if isinstance(param, click.Option) and param.is_flag and not param.secondary_opts:
        return None if not default else "on"
    if isinstance(default, enum.Enum):
        default = default.value
    if isinstance(default, (list, tuple)):
        default = " ".join(str(d) for d in default)
    return str(default)


# 2. the blocks


def blocks_page() -> str:
    """Every public name of `prefect_gpu_budget.blocks`: what it is, and each field with its
    type, default and description."""
    import prefect_gpu_budget.blocks as blocks

    parts = [
        "# Blocks reference\n",
        "Generated from the blocks' pydantic fields when the manual is built. Each block is saved "
        "and loaded as any Prefect block (`.save(name)`, `.load(name)`); `apply()` where a block "
        "has it writes it to the ledger.\n",
    ]
    for name in blocks.__all__:
        parts.append(_block_section(name, getattr(blocks, name)))
    return "\n".join(parts)


def _block_section(name: str, cls: type) -> str:
    lines = [f"## `{name}`\n"]
    slug = getattr(cls, "_block_type_slug", None) or getattr(cls, "get_block_type_slug", None)
    if callable(slug):
        slug = slug()
    where = f"`{cls.__module__.rsplit('.', 1)[0]}.{name}`"
    lines.append(
        f"{where}" + (f", block type `{slug}`" if slug else " (a model inside a block)") + ".\n"
    )
    doc = inspect.getdoc(cls)
    if doc:
        lines.append(_text(doc) + "\n")
    lines.append("| field | type | default | description |")
    lines.append("| --- | --- | --- | --- |")
    for field_name, field in cls.model_fields.items():
        default = "required" if field.is_required() else _field_default(field)
        lines.append(
            f"| `{field_name}` | {_cell(_text(_type(field.annotation)))} | {_cell(default)} | "
            f"{_cell(_text(field.description or ''))} |"
        )
    return "\n".join(lines) + "\n"


def _field_default(field) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "computed"
    else:
        value = field.default
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{value!r}`"


def _type(annotation: object) -> str:
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    said = repr(annotation)
    said = re.sub(r"\b(typing|pydantic|prefect[\w.]*|prefect_gpu_budget[\w.]*)\.", "", said)
    said = re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).rsplit(".", 1)[-1], said)
    return said


# 3. text


def _text(said: str) -> str:
    """Help text as markdown: its angle brackets shown, not taken for HTML; Typer's `\\b`
    paragraph marks dropped."""
    said = said.replace("\b", "")
    return html.escape(said, quote=False)


def _cell(said: str) -> str:
    return said.replace("\n", " ").replace("|", "\\|")
