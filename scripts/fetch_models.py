"""Fetch bundled registry models into the local cache and print where each one is.

    python scripts/fetch_models.py                       # smollm2-135m-instruct only
    python scripts/fetch_models.py qwen2.5-coder-0.5b-instruct
    python scripts/fetch_models.py all=true              # or --all
    python scripts/fetch_models.py list=true             # or --list
    python scripts/fetch_models.py gsm8k_from=../shared/data/gsm8k   # + copy GSM8K into the cache

The cache is `$DRAFTSMITH_CACHE/models/<name>` (default `~/.cache/draftsmith/models/<name>`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from draftsmith.config import option, parse_script
from draftsmith.data.sources import gsm8k_dir
from draftsmith.errors import UserError, exit_with
from draftsmith.models import registry
from draftsmith.models.bundled import DEFAULT_TARGET

DEFAULT_MODELS = [DEFAULT_TARGET]


def copy_gsm8k(source: Path) -> Path:
    """Copy {train,test}.jsonl into data.sources.gsm8k_dir() (each file written whole, then renamed)."""
    out = gsm8k_dir()
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        if not (source / f"{split}.jsonl").is_file():
            raise UserError(f"gsm8k_from={source}: {split}.jsonl is missing there")
        tmp = out / f".{split}.jsonl.tmp"
        shutil.copyfile(source / f"{split}.jsonl", tmp)
        os.replace(tmp, out / f"{split}.jsonl")
    return out


@dataclass
class FetchConfig:
    names: List[str] = option(factory=lambda: list(DEFAULT_MODELS), help="registry names (also the bare words)")
    all: bool = option(False, "fetch every registry model")
    list: bool = option(False, "list registry models and whether they are fetched")
    keep_gguf: bool = option(False, "keep the assembled GGUF of split models")
    quiet: bool = option(False, "no progress output")
    gsm8k_from: Optional[str] = option(None, "copy GSM8K's train.jsonl/test.jsonl from this folder into the cache "
                                             "(data.sources.gsm8k_dir)")


def main(argv: list[str] | None = None) -> int:
    args = parse_script("scripts/fetch_models.py", __doc__.split("\n\n")[0], FetchConfig,
                        sys.argv[1:] if argv is None else argv, rest="names")
    if args.gsm8k_from:
        print(f"gsm8k: {copy_gsm8k(Path(args.gsm8k_from))}")

    if args.list:
        for name in registry.list_models():
            state = "fetched" if registry.is_fetched(name) else "not fetched"
            print(f"{name:32s} {state:12s} {registry.model_dir(name)}  # {registry.get(name).description}")
        return 0
    names = registry.list_models() if args.all else args.names
    unknown = [n for n in names if n not in registry.REGISTRY]
    if unknown:  # fail on a typo before spending minutes on the names before it
        raise UserError(f"unknown registry model(s) {', '.join(unknown)}; valid names: {', '.join(registry.list_models())}")
    for name in names:
        t0 = time.perf_counter()
        path = registry.fetch(name, progress=not args.quiet, keep_gguf=args.keep_gguf)
        print(f"{name}: {path}  ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    exit_with(main)
