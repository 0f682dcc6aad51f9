"""The papers' policies (`draftsmith.eval.policies`, folder `eval/policies/`): loops and placements built on the
decode core. `pipeline.py` (PEARL-style pipelined drafting), `selfdraft.py` (Self-Draft), `placement.py` (Dovetail:
the drafter on another device), `hcmp.py` (Ghidorah HCMP), `arca.py` (Ghidorah ARCA's tree choice). They import only
`eval/decode/` (tests/test_architecture.py checks it); the bench reaches them through `eval/bench/methods.py`.
"""
