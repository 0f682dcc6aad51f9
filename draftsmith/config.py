"""Typed configuration for every command: YAML + dotted `key=value` overrides -> nested dataclasses.

One system for recipes, data jobs, the benchmark and the profiler:

    python -m draftsmith.eval.bench --config bench.yaml target=qwen2.5-coder-1.5b-instruct num_prompts=8
    python train/medusa.py --config train/configs/medusa_tiny.yaml train.max_steps=10 --print-config

- A config is a dataclass tree; each field is declared once with `option(default, help, bounds)`.
  Unknown keys are rejected with the valid keys listed (and a "did you mean"), values are checked
  against the annotation (`depth: expected an integer, got 'abc'`) and against the declared bounds
  (`optim.lr: must be > 0, got -0.01`), all before any work starts.
- Values in overrides are YAML scalars (`train.max_steps=10`, `optim.lr=1e-3`, `wandb=true`); a
  list field also takes a space-separated string (`methods="plain ngram lm-chain:budget=4"`).
- `--help` lists every key with its type, default and meaning; `--print-config` prints the resolved
  config as YAML and exits.
- Types that parse themselves (method specs in `eval.bench.methods`) subclass `Parsable`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import json
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from draftsmith.errors import UserError

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)
MISSING = dataclasses.MISSING


class TextEnum(str, enum.Enum):
    """An option's choices: each member is its text (YAML, the command line and saved configs keep the text; the
    config system coerces text to the member), and code dispatches on the members, never on the text."""

    def __str__(self) -> str:
        return self.value


class ConfigError(UserError):
    """A config value or key is invalid; the message names the key path."""


class ConfigFileNotFound(ConfigError, FileNotFoundError):
    """The --config file does not exist."""


class Parsable:
    """A config value type that builds itself from a raw (YAML) value: `from_config(value, path)`."""

    @classmethod
    def from_config(cls, value: Any, path: str) -> "Parsable":
        raise NotImplementedError

    def to_config(self) -> Any:
        """The raw value `from_config` reads back (default: the text it was written as)."""
        return str(self)


def option(default: Any = MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
           ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None) -> Any:
    """A dataclass field with its meaning (`help`, shown by --help) and bounds checked at load time.

    Bounds apply to numbers (each item of a list of numbers); None values are not checked.
    """
    metadata = {"help": help, "bounds": {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt))
                                          if v is not None}}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type, help: str = "", **overrides: Any) -> Any:
    """A nested config section (a dataclass field built with `cls(**overrides)` by default)."""
    return dataclasses.field(default_factory=lambda: cls(**overrides), metadata={"help": help, "bounds": {}})


# ---------------------------------------------------------------------------------------------
# Checking values against annotations
# ---------------------------------------------------------------------------------------------


def join_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(str(member.value) for member in tp)
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def enum_member(kind: type[E], value: Any, what: str) -> E:
    """`value` as a member of `kind`, an Enum of text values (its text accepted: a model config read from JSON, a
    library call), or one ConfigError line naming `what` and the choices; for typed fields outside a checked config."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{what} must be one of {[member.value for member in kind]}, got {value!r}") from None


def _coerce_enum(value: Any, tp: type[enum.Enum], path: str) -> enum.Enum:
    """A member of an Enum of text values (`backend=compiled` -> Backend.COMPILED)."""
    if isinstance(value, tp):
        return value
    choices = [member.value for member in tp]
    if value not in choices:
        raise ConfigError(f"{path}: {value!r} is not one of {choices}")
    return tp(value)


def _coerce_union(value: Any, tp: Any, path: str) -> Any:
    args = typing.get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{path}: must not be null (expected {type_name(tp)})")
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce(value, arg, path)
        except ConfigError as err:
            errors.append(str(err))
    raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {type_name(tp)}")


def _coerce_sequence(value: Any, tp: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(value, str):  # `methods="plain ngram"`, `widths="1 2 4"` on the command line
        numeric = bool(args) and args[0] in (int, float, bool)
        value = [_scalar_word(word) if numeric else word for word in list_words(value)]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected a list, got {value!r}")
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
        return tuple(coerce(v, a, join_path(path, i)) for i, (v, a) in enumerate(zip(value, args)))
    item = args[0] if args else Any
    items = [coerce(v, item, join_path(path, i)) for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


BRACKETS = {"(": 1, "[": 1, ")": -1, "]": -1}  # how each bracket moves the nesting depth


def _closes_at_end(text: str) -> bool:
    """Whether the bracket opening `text` closes at its last character."""
    depth = 0
    for index, char in enumerate(text):
        depth += BRACKETS.get(char, 0)
        if depth == 0:
            return index == len(text) - 1
    return False


def list_words(text: str) -> list[str]:
    """The items of a list given as text: words split at whitespace outside brackets (`cascade:drafters=[(ngram),
    dgf]` is one word), a comma ending a word dropped, and brackets around the whole list (text YAML did not read as
    a list, e.g. `[cascade:drafters=[ngram]]`) dropped."""
    text = text.strip()
    if text.startswith("[") and _closes_at_end(text):
        text = text[1:-1]
    words, current, depth = [], [], 0
    for char in text:
        depth += BRACKETS.get(char, 0)
        if char.isspace() and depth <= 0:
            words.append("".join(current))
            current = []
        else:
            current.append(char)
    words.append("".join(current))  # an unbalanced last word too: its parser names the brackets
    return [word.removesuffix(",") for word in words if word.removesuffix(",")]


def _scalar_word(word: str) -> Any:
    try:
        return yaml.safe_load(word)
    except yaml.YAMLError:
        return word


def _coerce_scalar(value: Any, tp: Any, path: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r} (quote it: {path}='{value}')")
        return value
    raise ConfigError(f"{path}: unsupported annotation {type_name(tp)}")


def coerce(value: Any, tp: Any, path: str) -> Any:
    """Check (and lightly convert) `value` against the annotation `tp`; errors name `path`."""
    if tp is Any:
        return value
    if isinstance(tp, type) and issubclass(tp, Parsable):
        return value if isinstance(value, tp) else tp.from_config(value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _coerce_enum(value, tp, path)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return value if isinstance(value, tp) else config_from_dict(tp, value, path)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, tp, path)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if value is None:
        raise ConfigError(f"{path}: must not be null (expected {type_name(tp)})")
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        return _coerce_sequence(value, tp, path)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        value_type = typing.get_args(tp)[1] if typing.get_args(tp) else Any
        return {str(k): coerce(v, value_type, join_path(path, str(k))) for k, v in value.items()}
    return _coerce_scalar(value, tp, path)


_BOUND_TEXT = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
               "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def check_bounds(value: Any, bounds: Mapping[str, float], path: str) -> None:
    """Raise ConfigError when a number (or any number in a list) is outside `bounds`."""
    if value is None or not bounds:
        return
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not isinstance(item, (int, float)) or isinstance(item, bool):
            continue
        if isinstance(item, float) and not math.isfinite(item):
            raise ConfigError(f"{path}: must be a finite number, got {item}")
        for kind, bound in bounds.items():
            symbol, ok = _BOUND_TEXT[kind]
            if not ok(item, bound):
                raise ConfigError(f"{path}: must be {symbol} {bound:g}, got {item}")


# ---------------------------------------------------------------------------------------------
# Building configs
# ---------------------------------------------------------------------------------------------


def _reject_unknown(cls: type, data: Mapping, fields: Mapping, path: str, noun: str) -> None:
    where = f" at {path}" if path else ""
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {join_path(path, close[0])!r}?)" if close else ""
            raise ConfigError(f"unknown {noun} {join_path(path, str(key))!r}{hint}; valid {noun}s{where}: "
                              f"{', '.join(sorted(fields))}")


def config_from_dict(cls: type[T], data: Any, path: str = "", noun: str = "config key") -> T:
    """Build the dataclass `cls` from a (nested) mapping: unknown keys, wrong types and out-of-bounds
    values are ConfigErrors naming the key path (`noun`: what a key is called in messages)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'the top level'}: expected a mapping of keys to values, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    _reject_unknown(cls, data, fields, path, noun)
    kwargs = {}
    for name, f in fields.items():
        key_path = join_path(path, name)
        if name in data:
            kwargs[name] = coerce(data[name], hints[name], key_path)
            check_bounds(kwargs[name], f.metadata.get("bounds", {}), key_path)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"missing required {noun} {key_path!r}" + (f" ({f.metadata['help']})"
                                                                         if f.metadata.get("help") else ""))
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{path or cls.__name__}: {err}") from err


def check_config(cfg: Any, path: str = "") -> None:
    """Check the declared bounds of every field of a config instance (programmatic configs call it in
    __post_init__, so a bad value is refused wherever the config is built)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        check_bounds(value, f.metadata.get("bounds", {}), join_path(path, f.name))
        enum_type = _enum_of(hints.get(f.name))
        if enum_type is not None and value is not None:  # a programmatic config may pass the text value
            items = [_coerce_enum(item, enum_type, join_path(path, f.name)) for item in
                     (value if isinstance(value, list) else [value])]
            setattr(cfg, f.name, items if isinstance(value, list) else items[0])


def _enum_of(tp: Any) -> type[enum.Enum] | None:
    """The Enum of an annotation `E`, `E | None` or `list[E]` (else None)."""
    candidates = [tp, *typing.get_args(tp)]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, enum.Enum)), None)


def config_to_dict(cfg: Any) -> dict:
    """Plain nested dict (lists for tuples) of a config dataclass, safe for YAML/JSON; read back by the
    same loader (`Parsable` values as they are written, e.g. method specs as text)."""
    return json.loads(json.dumps(_raw_value(cfg), default=str))


def _raw_value(value: Any) -> Any:
    if isinstance(value, Parsable):
        return value.to_config()
    if isinstance(value, TextEnum):
        return value.value  # its text, as the config gave it
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _raw_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_raw_value(item) for item in value]
    if isinstance(value, dict):
        return {key: _raw_value(item) for key, item in value.items()}
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.max_steps=10` -> (["train", "max_steps"], 10); values are parsed as YAML scalars."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or key.strip().startswith("-"):
        raise ConfigError(f"{text!r} is neither a known flag nor a key.path=value override")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # e.g. `methods=lm-tree:depth=4,topk=3`: not YAML, meant as a plain string
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Set `key.path=value` overrides in a raw config mapping (checked when the config is built)."""
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for i, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(keys[:i + 1])!r} is not a section")
            node = child
        node[keys[-1]] = value
    return raw


def read_yaml_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigFileNotFound(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    return raw


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Read a YAML file (optional), apply overrides, and build the typed config `cls`."""
    raw = read_yaml_config(path) if path is not None else {}
    return config_from_dict(cls, apply_overrides(raw, overrides))


def save_config(cfg: Any, path: str | Path, header: str | None = None) -> None:
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    Path(path).write_text((f"# {header}\n" if header else "") + text)


def flatten_dict(d: Mapping, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; non-scalar leaves become strings."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten_dict(v, key))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out


# ---------------------------------------------------------------------------------------------
# Help and the command line
# ---------------------------------------------------------------------------------------------


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not MISSING:
        if isinstance(f.default, enum.Enum):
            return repr(f.default.value)
        return repr(f.default) if isinstance(f.default, str) else json.dumps(f.default, default=str)
    if f.default_factory is not MISSING:
        value = f.default_factory()
        return json.dumps(value if not dataclasses.is_dataclass(value) else "{...}", default=str)
    return "(required)"


def config_keys(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key path, type, default, help) of every leaf key of a config dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key, tp = join_path(prefix, f.name), hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            rows += config_keys(tp, key)
            continue
        bounds = f.metadata.get("bounds", {})
        limits = ", ".join(f"{_BOUND_TEXT[k][0]} {v:g}" for k, v in bounds.items())
        text = f.metadata.get("help", "") + (f" [{limits}]" if limits else "")
        rows.append((key, type_name(tp), _default_text(f), text))
    return rows


def format_keys(cls: type) -> str:
    rows = config_keys(cls)
    width = max((len(key) for key, *_ in rows), default=10)
    lines = ["config keys (set with key=value after the flags, or in --config YAML):"]
    for key, tp, default, text in rows:
        lines.append(f"  {key:<{width}}  {tp} = {default}" + (f"\n  {'':<{width}}    {text}" if text else ""))
    return "\n".join(lines)


def command_parser(prog: str, description: str, config_cls: type) -> argparse.ArgumentParser:
    """An argparse parser with --config, --print-config, --debug and the `key=value` overrides; the
    help lists every config key. Commands add their own flags (e.g. --resume) before parsing."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=format_keys(config_cls),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="YAML", default=None, help="YAML file with config keys")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.max_steps=10")
    return parser


class ArgumentError(UserError):
    """A command-line flag was misused (argparse's message, without the usage text)."""


class _QuietParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ArgumentError(f"{message} (see {self.prog} --help)")


def flag_overrides(words: Sequence[str], config_cls: type) -> list[str]:
    """Config keys written as flags: `--backend compiled`, `--compile.autotune=false`, `--strict` (true)
    -> `key=value` overrides; anything else is passed on (and refused by the loader)."""
    keys = {f.name for f in dataclasses.fields(config_cls)}
    out, words = [], list(words)
    while words:
        word = words.pop(0)
        name, sep, value = word[2:].partition("=")
        key = name.replace("-", "_")
        if not word.startswith("--") or key.split(".")[0] not in keys:
            out.append(word)
        elif sep:
            out.append(f"{key}={value}")
        elif words and not words[0].startswith("--"):
            out.append(f"{key}={words.pop(0)}")
        else:
            out.append(f"{key}=true")
    return out


def parse_command(parser: argparse.ArgumentParser, config_cls: type[T],
                  argv: Sequence[str]) -> tuple[T, argparse.Namespace]:
    """(config, flags) from argv; --print-config prints the YAML and exits 0."""
    parser.__class__ = _QuietParser  # flag misuse -> one `error:` line (run_main), not argparse's exit
    args, unknown = parser.parse_known_args(flag_overrides(argv, config_cls))
    overrides = unknown + list(args.overrides)  # an unknown --flag is reported before stray values
    cfg = load_config(config_cls, args.config, overrides)
    if args.print_config:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        raise SystemExit(0)
    return cfg, args


def parse_script(prog: str, description: str, config_cls: type[T], argv: Sequence[str],
                 positional: Sequence[str] = (), rest: str | None = None) -> T:
    """A small command's config from its command line: `key=value` (or `--key value`, `--flag`) for every key,
    `--help` listing them; bare words fill the `positional` keys in order, then (with `rest`) that list key, so
    `cmd RUN --out X` and `cmd run=RUN out=X` mean the same."""
    parser = command_parser(prog, description, config_cls)
    words = flag_overrides(argv, config_cls)
    bare = [word for word in words if "=" not in word and not word.startswith("-")]
    keyed = [word for word in words if "=" in word or word.startswith("-")]
    overrides = [f"{key}={json.dumps(word)}" for key, word in zip(positional, bare)]
    extra = bare[len(positional):]
    if extra and rest is None:
        raise ConfigError(f"{' '.join(extra)!r}: not a key=value override (see {prog} --help)")
    if extra:
        overrides.append(f"{rest}={json.dumps(extra)}")
    cfg, _ = parse_command(parser, config_cls, keyed + overrides)
    return cfg


# ---------------------------------------------------------------------------------------------
# Options the chosen mode does not read
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Unread:
    """`path` (a dotted key) is not read when `unread(config)` holds; `reader` says what would read it."""

    path: str
    unread: Callable[[Any], bool]
    reader: str


def declared_default(cls: type, path: str) -> Any:
    """The default a dotted key has in a config class (a section's overrides included)."""
    head, _, rest = path.partition(".")
    f = next(f for f in dataclasses.fields(cls) if f.name == head)
    value = f.default if f.default is not MISSING else f.default_factory()
    return _dig(value, rest) if rest else value


def _dig(value: Any, path: str) -> Any:
    for key in path.split(".") if path else []:
        value = getattr(value, key)
    return value


def refuse_unread(cfg: Any, rules: Sequence[Unread]) -> None:
    """An option set away from its default that this configuration does not read is refused by name, with
    what would read it: a user who sets it must not believe it is in effect."""
    for rule in rules:
        if rule.unread(cfg) and _dig(cfg, rule.path) != declared_default(type(cfg), rule.path):
            raise ConfigError(f"{rule.path}={_raw_value(_dig(cfg, rule.path))!r} is not read here: {rule.reader}; "
                              "drop it")
