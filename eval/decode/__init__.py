"""The decode core (`draftsmith.eval.decode`, folder `eval/decode/`): what one speculative decode needs.

`tree.py` and `verify.py` are pure tensor functions (trees, masks, positions, greedy verification, speculative
sampling); `decoder.py` is the one decode loop and its public pieces (`Generation`, `SpeculativeDecoder`);
`drafters/` holds one interface (`drafters/base.py`) and one file per drafter. Nothing here imports the rest of
`eval` (tests/test_architecture.py checks it): the policies (`eval/policies/`) and the harness (`eval/*.py`) sit
on top of it.
"""
