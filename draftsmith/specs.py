"""The one grammar of the toolkit's short specs, documented here once and parsed here once:

    name[:first][,key=value,...]

- `name`: a table entry: a bench method (`eval/bench/methods.py`, `eval/engines/llamacpp_bench.py`), a data source kind
  (`data/sources`), or `tiny` (an in-process tiny model, `models/tiny.py`).
- `first`: the entry's one positional value, the first item after `:` when it has no `=` (a path, a split, a
  model family): `medusa:outputs/run/final`, `gsm8k:train`, `tiny:llama`.
- `key=value`: the entry's named options, checked against its table (an unknown key is refused, naming the valid
  ones). Values in () or [] may hold commas: a nested spec `(lm-chain:budget=4)`, a list `[(ngram),dgf]`.

Examples: `lm-tree:depth=4,topk=3`, `dgf:outputs/run/final,budget=5`, `gsm8k:train,limit=100`,
`hf:openai/gsm8k,split=test`, `tiny:qwen2,seed=3`. Every error is one line `<what>: <the problem>`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.config import BRACKETS
from draftsmith.errors import UserError


class SpecError(UserError):
    """A spec that does not follow the grammar."""


@dataclass(frozen=True)
class SpecText:
    """A spec split by the grammar (values still text: the entry's table types them)."""

    name: str
    first: str | None = None
    options: dict[str, str] = field(default_factory=dict)


def split_top(text: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside () and [] (`a,b=(c,d),e=[f,g]` -> 3 items)."""
    items, depth, current = [], 0, []
    for char in text:
        depth += BRACKETS.get(char, 0)
        if depth < 0:
            raise SpecError(f"unbalanced brackets in {text!r}")
        if char == sep and depth == 0:
            items.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise SpecError(f"unbalanced brackets in {text!r}")
    items.append("".join(current).strip())
    return [item for item in items if item]


def split_items(text: str) -> tuple[str | None, dict[str, str]]:
    """The part after `name:` -> (first positional value or None, {key: value text})."""
    first, options = None, {}
    for index, item in enumerate(split_top(text)):
        key, eq, value = item.partition("=")
        if not eq or any(c in key for c in "([:"):
            if index == 0:
                first = item
                continue
            raise SpecError(f"{item!r}: only the first item may be given without a key; write key=value")
        key = key.strip()
        if key in options:
            raise SpecError(f"{key!r} is given twice")
        options[key] = value.strip()
    return first, options


def check_spec_name(text: str, name: str) -> None:
    """A name holds no option: `ngram,budget=4` is refused with the form that was meant (`ngram:budget=4`)."""
    if "=" in name and "," not in name.split("=")[0]:
        raise SpecError(f"{text!r} is an option, not a spec: a YAML list splits a spec's options at its commas; quote "
                        "each spec (\"['lm-tree:depth=4,topk=3', ngram]\") or separate the specs by spaces")
    if any(char in name for char in ",=()[] "):
        head = name.split(",")[0].split("=")[0].strip()
        raise SpecError(f"{text!r}: a spec is name[:first][,key=value,...] (options follow a colon: "
                        f"`{head}:key=value`)")


def parse_spec(text: str) -> SpecText:
    """`name[:first][,key=value,...]` -> SpecText."""
    if not isinstance(text, str) or not text.strip():
        raise SpecError(f"a spec is name[:first][,key=value,...], got {text!r}")
    name, _, rest = text.strip().partition(":")
    check_spec_name(text, name)
    first, options = split_items(rest)
    return SpecText(name.strip(), first, options)
