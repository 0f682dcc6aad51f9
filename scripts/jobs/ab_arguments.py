"""The arguments the in-process A/B scripts share: [float32 | bfloat16] [prompts] [output.json], checked in one line
each (an existing output file is refused: nothing is overwritten)."""
import sys
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def ab_arguments(argv: list[str], script: str) -> tuple[str, int, str | None]:
    """(dtype name, prompts, output path or None) of `argv`, or exit with the usage line of `script`."""
    if len(argv) > 3 or (argv and argv[0] not in DTYPES) or (len(argv) > 1 and not argv[1].isdigit()):
        sys.exit(f"usage: python scripts/jobs/{script} [{' | '.join(DTYPES)}] [prompts] [output.json]")
    if len(argv) > 2 and Path(argv[2]).exists():
        sys.exit(f"error: {argv[2]} exists: give a new output path (nothing is overwritten)")
    return (argv[0] if argv else "float32", int(argv[1]) if len(argv) > 1 else 12,
            argv[2] if len(argv) > 2 else None)
