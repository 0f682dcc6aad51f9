"""Fetch bundled zoo models into the local cache and print where each one is.

    python scripts/fetch_models.py                       # smollm2-135m-instruct only
    python scripts/fetch_models.py qwen2.5-coder-0.5b-instruct
    python scripts/fetch_models.py --all
    python scripts/fetch_models.py --list
    python scripts/fetch_models.py --gsm8k-from ../shared/data/gsm8k   # + copy GSM8K into the cache

The cache is `$DRAFTSMITH_CACHE/models/<name>` (default `~/.cache/draftsmith/models/<name>`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from draftsmith.data.sources import gsm8k_dir
from draftsmith.errors import UserError, exit_with
from draftsmith.models import zoo
from draftsmith.models.bundled import DEFAULT_TARGET

DEFAULT_MODELS = [DEFAULT_TARGET]


def copy_gsm8k(source: Path) -> Path:
    """Copy {train,test}.jsonl into data.sources.gsm8k_dir() (each file written whole, then renamed)."""
    out = gsm8k_dir()
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        if not (source / f"{split}.jsonl").is_file():
            raise UserError(f"--gsm8k-from {source}: {split}.jsonl is missing there")
        tmp = out / f".{split}.jsonl.tmp"
        shutil.copyfile(source / f"{split}.jsonl", tmp)
        os.replace(tmp, out / f"{split}.jsonl")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"zoo names (default: {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--all", action="store_true", help="fetch every zoo model")
    parser.add_argument("--list", action="store_true", help="list zoo models and whether they are fetched")
    parser.add_argument("--keep-gguf", action="store_true", help="keep the assembled GGUF of split models")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument("--gsm8k-from", metavar="DIR", default=None,
                        help="copy GSM8K's train.jsonl/test.jsonl from DIR into the cache (data.sources.gsm8k_dir)")
    args = parser.parse_args(argv)
    if args.gsm8k_from:
        print(f"gsm8k: {copy_gsm8k(Path(args.gsm8k_from))}")

    if args.list:
        for name in zoo.list_models():
            state = "fetched" if zoo.is_fetched(name) else "not fetched"
            print(f"{name:32s} {state:12s} {zoo.model_dir(name)}  # {zoo.get(name).description}")
        return 0
    names = zoo.list_models() if args.all else (args.names or DEFAULT_MODELS)
    unknown = [n for n in names if n not in zoo.REGISTRY]
    if unknown:  # fail on a typo before spending minutes on the names before it
        raise UserError(f"unknown zoo model(s) {', '.join(unknown)}; valid names: {', '.join(zoo.list_models())}")
    for name in names:
        t0 = time.perf_counter()
        path = zoo.fetch(name, progress=not args.quiet, keep_gguf=args.keep_gguf)
        print(f"{name}: {path}  ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    exit_with(main)
