"""The benchmark harness: `python -m draftsmith.eval.bench` (run.py: config, the interleaved loop, the JSON and
table), the method table it builds decoders from (methods.py, build_context.py, hf_methods.py), its resumable
progress file (progress.py), the report (report.py) and the generated block of RESULTS.md (results_page.py)."""
