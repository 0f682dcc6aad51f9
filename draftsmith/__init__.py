"""draftsmith: train, distill and honestly measure draft models for lossless speculative decoding.

The package is installed from the repository's folders (see pyproject.toml): `draftsmith.models`
is `models/`, `draftsmith.data` is `data/`, `draftsmith.eval` is `eval/`, `draftsmith.train` is
`train/`, `draftsmith.scripts` is `scripts/`; this folder holds the package root and the
infrastructure every layer shares (typed config and CLI, user errors, file integrity).
"""

__version__ = "0.2.0"
