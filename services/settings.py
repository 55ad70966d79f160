"""One mechanism for every service's settings (engine, gateway, dashboard).

A service's settings are one frozen dataclass; each field that a user may set carries a
`Setting` (made with `setting(...)`): its environment variable(s), its flag (or none), a help
text, a parser for the string forms ("4g", "a,b", "auto") and whether it is a secret. From that
one declaration this module builds the argparse flags, reads the environment, converts and checks
the strings (a bad one raises `SettingsError` naming the flag or variable and what to write
instead), applies flag > environment > default, and renders --help and the README tables.

  - A byte count is a `size_setting`: "4096", "512m", "4g" (binary units), shown the same way.
  - An empty variable counts as unset (compose passes `${X:-}` through as "").
  - A secret is hidden from repr, --help and the tables; it is read from NAME or, when NAME is
    unset, from the file NAME_FILE names (its text, stripped). NAME wins.
  - A setting may have a file form of its own (`file_env`/`file_flag`/`parse_file`); with both
    forms given, `merge(file_value, inline_value)` combines them (default: the inline one wins).
  - A repeatable flag (`repeat=True`) collects every occurrence: the parsed tuples are joined.
  - A model with a class attribute `env_prefix` (ClassVar) makes each of its fields without a
    `setting(...)` a setting too: flag --<field-name>, variable <prefix><FIELD_NAME>, parser from
    the type. `internal(...)` marks a field that is never read from flags or the environment.

`python -m keepwarm.settings README.md` rewrites the tables between
`<!-- settings-table module:Class -->` and `<!-- /settings-table -->` from the models.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_KEY = "keepwarm.setting"
_DERIVED = "<derived>"  # the flag "--<field-name>" (a string: equal under `python -m` too)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingsError(ValueError):
    """A bad setting; the message names the flag or variable and says what to change."""


@dataclasses.dataclass(frozen=True)
class Setting:
    help: str = ""
    flag: str | None = _DERIVED  # "--name", None (environment only), or derived from the field name
    env: tuple[str, ...] | None = None  # looked up in order, the first set one wins; None: derived
    parse: Callable[[str], Any] | None = None  # None: from the field's type
    show: Callable[[Any], str] | None = None  # a value as text (--help, tables, to_env)
    default_text: str | None = None  # what --help says the default is, when the value says it badly
    secret: bool = False
    file_env: tuple[str, ...] | None = None  # None: NAME_FILE for a secret, none otherwise
    file_flag: str | None = None
    parse_file: Callable[[str], Any] | None = None  # a file's text -> value; None: parse(text.strip())
    merge: Callable[[Any, Any], Any] | None = None  # (file value, inline value) -> value
    repeat: bool = False
    metavar: str | None = None


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    help: str = "",
    flag: str | None = _DERIVED,
    env: tuple[str, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
    show: Callable[[Any], str] | None = None,
    default_text: str | None = None,
    secret: bool = False,
    file_env: tuple[str, ...] | None = None,
    file_flag: str | None = None,
    parse_file: Callable[[str], Any] | None = None,
    merge: Callable[[Any, Any], Any] | None = None,
    repeat: bool = False,
    metavar: str | None = None,
) -> Any:
    """A dataclass field that flags and the environment fill (see the module docstring)."""
    meta = Setting(
        help=help,
        flag=flag,
        env=env,
        parse=parse,
        show=show,
        default_text=default_text,
        secret=secret,
        file_env=file_env,
        file_flag=file_flag,
        parse_file=parse_file,
        merge=merge,
        repeat=repeat,
        metavar=metavar,
    )
    return dataclasses.field(
        default=default, default_factory=default_factory, repr=not secret, metadata={_KEY: meta}
    )


def internal(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A field no flag or variable sets (derived by the service, or fixed)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_KEY: None})


@dataclasses.dataclass(frozen=True)
class Spec:
    """One field's setting, names and parsers resolved."""

    name: str
    flag: str | None
    env: tuple[str, ...]
    file_env: tuple[str, ...]
    file_flag: str | None
    parse: Callable[[str], Any]
    parse_file: Callable[[str], Any]
    show: Callable[[Any], str]
    default: Any  # dataclasses.MISSING when required
    default_text: str
    help: str
    secret: bool
    merge: Callable[[Any, Any], Any] | None
    repeat: bool
    metavar: str | None

    @property
    def file_dest(self) -> str:
        assert self.file_flag is not None
        return self.file_flag.lstrip("-").replace("-", "_")


# --- parsers and formatters for the plain types ---------------------------------------------


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError("expected true or false (or 1/0, yes/no, on/off)")


def parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("expected a whole number") from None


def parse_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError("expected a number") from None


def parse_list(text: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c')."""
    return tuple(s.strip() for s in text.split(",") if s.strip())


def show_value(value: Any) -> str:
    """A value as the text that parses back to it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, tuple):
        return ",".join(show_value(v) for v in value)
    if isinstance(value, Mapping):
        return ",".join(f"{k}:{v}" for k, v in value.items())
    return str(value)


def _parser_for(tp: Any, field: str) -> Callable[[str], Any]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _parser_for(inner[0], field)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _parser_for(args[0], field)
        return lambda text: tuple(item(s) for s in parse_list(text))
    simple: dict[Any, Callable[[str], Any]] = {
        bool: parse_bool,
        int: parse_int,
        float: parse_float,
        str: str,
        Path: Path,
        bytes: str.encode,
    }
    if tp in simple:
        return simple[tp]
    raise TypeError(f"setting {field!r} of type {tp!r}: give it a parser (setting(parse=...))")


def parse_size(text: str) -> int:
    """Bytes from '4096', '512m', '4g', '1.5G' (binary units)."""
    s = str(text).strip().lower().removesuffix("ib").removesuffix("b")
    mult = 1
    if s and s[-1] in "kmgt":
        mult = 1024 ** ("kmgt".index(s[-1]) + 1)
        s = s[:-1]
    try:
        value = float(s)
    except ValueError:
        raise SettingsError(
            f"size {text!r} is not a number with an optional k/m/g/t suffix (4g, 512m)"
        ) from None
    if value < 0:
        raise SettingsError(f"size {text!r} must not be negative")
    return int(value * mult)


def format_size(n: int | None) -> str:
    """The shortest text parse_size reads back as n: 17179869184 -> '16g'."""
    if n is None:
        return "auto"
    for power, unit in ((4, "t"), (3, "g"), (2, "m"), (1, "k")):
        if n and n % 1024**power == 0:
            return f"{n // 1024**power}{unit}"
    return str(n)


def size_setting(default: int, help: str, **names: Any) -> Any:
    """A byte-count setting: read as `4g`, `512m`, `4096` (parse_size), shown the same way;
    `names` are setting()'s flag= / env=."""
    return setting(default, parse=parse_size, show=format_size, help=help, **names)


# --- the model's specs ------------------------------------------------------------------------


@functools.cache
def specs(model: type) -> tuple[Spec, ...]:
    """The settings of a settings dataclass, in field order."""
    assert dataclasses.is_dataclass(model), model
    prefix: str | None = getattr(model, "env_prefix", None)
    hints = typing.get_type_hints(model)
    out: list[Spec] = []
    for f in dataclasses.fields(model):
        if _KEY in f.metadata:
            meta = f.metadata[_KEY]
            if meta is None:
                continue
        elif prefix is not None:
            meta = Setting()
        else:
            continue
        flag = "--" + f.name.replace("_", "-") if meta.flag == _DERIVED else meta.flag
        if meta.env is not None:
            env = meta.env
        else:
            assert prefix is not None, f"{model.__name__}.{f.name}: name its variable (env=...)"
            env = (prefix + f.name.upper(),)
        file_env = meta.file_env
        if file_env is None:
            file_env = tuple(n + "_FILE" for n in env) if meta.secret else ()
        parse = meta.parse or _parser_for(hints[f.name], f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        show = meta.show or show_value
        if meta.default_text is not None:
            default_text = meta.default_text
        elif default is dataclasses.MISSING:
            default_text = "(required)"
        elif meta.secret:
            default_text = "(unset)"
        else:
            default_text = show(default) or "(none)"
        out.append(
            Spec(
                name=f.name,
                flag=flag,
                env=env,
                file_env=file_env,
                file_flag=meta.file_flag,
                parse=parse,
                parse_file=meta.parse_file or (lambda text, p=parse: p(text.strip())),
                show=show,
                default=default,
                default_text=default_text,
                help=meta.help,
                secret=meta.secret,
                merge=meta.merge,
                repeat=meta.repeat,
                metavar=meta.metavar,
            )
        )
    return tuple(out)


def env_names(model: type) -> frozenset[str]:
    """Every variable the model reads (including *_FILE forms and aliases)."""
    return frozenset(n for s in specs(model) for n in (*s.env, *s.file_env))


# --- reading ----------------------------------------------------------------------------------


def _converted(spec: Spec, where: str, raw: str) -> Any:
    try:
        return spec.parse(raw)
    except ValueError as e:
        shown = "" if spec.secret else f" {raw!r}"
        default = "" if spec.secret else f" (default: {spec.default_text})"
        raise SettingsError(f"{where}{shown}: {e}{default}") from None


def _from_env(env: Mapping[str, str], names: Sequence[str]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name)
        if value:  # "" = unset
            return name, value
    return None


def _inline(spec: Spec, args: argparse.Namespace | None, env: Mapping[str, str]) -> Any:
    given = getattr(args, spec.name, None) if args is not None and spec.flag else None
    if given is not None:
        assert spec.flag is not None
        if spec.repeat:
            return tuple(x for raw in given for x in _converted(spec, spec.flag, raw))
        return _converted(spec, spec.flag, given)
    found = _from_env(env, spec.env)
    if found is None:
        return dataclasses.MISSING
    name, raw = found
    return _converted(spec, name, raw)


def _from_file(spec: Spec, args: argparse.Namespace | None, env: Mapping[str, str]) -> Any:
    given = getattr(args, spec.file_dest, None) if args is not None and spec.file_flag else None
    if given is not None:
        assert spec.file_flag is not None
        where, path = spec.file_flag, str(given)
    else:
        found = _from_env(env, spec.file_env)
        if found is None:
            return dataclasses.MISSING
        where, path = found
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SettingsError(
            f"cannot read {where} {path!r}: {e.strerror}; point it at a readable file"
        ) from None
    try:
        return spec.parse_file(text)
    except ValueError as e:
        raise SettingsError(f"{where} {path!r}: {e}") from None


def read(
    model: type, args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """{field: value} for each setting given by a flag (in `args`), a variable or a file."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for spec in specs(model):
        value = _inline(spec, args, env)
        if value is dataclasses.MISSING or spec.merge is not None:  # else the inline value wins unread
            from_file = _from_file(spec, args, env)
            if from_file is not dataclasses.MISSING:
                if value is dataclasses.MISSING:
                    value = from_file
                else:
                    assert spec.merge is not None
                    value = spec.merge(from_file, value)
        if value is not dataclasses.MISSING:
            values[spec.name] = value
    return values


def load(
    model: type[T],
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    **values: Any,
) -> T:
    """The model from flags > environment > defaults; `values` (derived by the caller) go last."""
    return model(**{**read(model, args, env), **values})


def to_env(settings: Any) -> dict[str, str]:
    """{variable: text} that `load` reads back to the same settings (secrets included: this is
    for a child process's environment, never for display)."""
    model: type = type(settings)
    return {
        s.env[0]: s.show(getattr(settings, s.name))
        for s in specs(model)
        if s.env and getattr(settings, s.name) is not None
    }


# --- flags, --help and the README tables --------------------------------------------------------


def _sources(spec: Spec) -> str:
    names = " / ".join(spec.env)
    if spec.file_env:
        names += " or the file in " + " / ".join(spec.file_env)
    return names


def add_arguments(parser: argparse.ArgumentParser, model: type) -> None:
    """One flag per setting that has one, its help naming the variables and the default; the
    environment-only settings are listed in the epilog."""
    env_only: list[str] = []
    for spec in specs(model):
        text = spec.help.replace("%", "%%")
        if spec.flag is None:
            env_only.append(f"{_sources(spec)}: {spec.help}")
            continue
        default = spec.default_text
        default = default[1:-1] if default.startswith("(") else f"default {default}"
        suffix = f"[env {_sources(spec)}; {default}]"  # a secret's default_text is never its value
        parser.add_argument(
            spec.flag,
            dest=spec.name,
            default=None,
            action="append" if spec.repeat else "store",
            metavar=spec.metavar or spec.flag.lstrip("-").replace("-", "_").upper(),
            help=f"{text} {suffix.replace('%', '%%')}".strip(),
        )
        if spec.file_flag:
            parser.add_argument(
                spec.file_flag,
                dest=spec.file_dest,
                default=None,
                metavar="FILE",
                help=f"file with the value of {spec.flag} [env {' / '.join(spec.file_env)}]",
            )
    if env_only:
        epilog = "environment only: " + "; ".join(env_only)
        parser.epilog = f"{parser.epilog}\n\n{epilog}" if parser.epilog else epilog


def markdown_table(model: type) -> str:
    """| flag | environment | default | meaning | — one row per setting."""

    def code(names: Sequence[str | None]) -> str:
        return ", ".join(f"`{n}`" for n in names if n) or "—"

    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for s in specs(model):
        env = code(s.env) + (f" or file: {code(s.file_env)}" if s.file_env else "")
        default = s.default_text if s.default_text.startswith("(") else f"`{s.default_text}`"
        cells = [code([s.flag, s.file_flag]), env, default, s.help]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


_BLOCK = re.compile(r"(<!-- settings-table ([\w.]+):(\w+) -->\n)(.*?)(<!-- /settings-table -->)", re.S)


def readme_blocks(text: str) -> list[tuple[type, str]]:
    """(model, the table text now in the README) for each settings-table block."""
    return [(_import(m[2], m[3]), m[4].strip()) for m in _BLOCK.finditer(text)]


def render_readme(text: str) -> str:
    """`text` with each settings-table block regenerated from its model."""
    return _BLOCK.sub(lambda m: m[1] + markdown_table(_import(m[2], m[3])) + "\n" + m[5], text)


def _import(module: str, name: str) -> type:
    return getattr(importlib.import_module(module), name)


def main(argv: Sequence[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)] or [Path("README.md")]
    for path in paths:
        old = path.read_text()
        new = render_readme(old)
        if new != old:
            path.write_text(new)
            print(f"rewrote the settings tables in {path}")
    return 0


if __name__ == "__main__":
    from keepwarm.settings import main as _main  # the module the models use, not this __main__ copy

    sys.exit(_main())
