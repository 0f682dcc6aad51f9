"""T(w) of the compiled 0.5B draft LM of the Qwen pair (32k sliced head, capacity 1024) per precision, one width at a time
in one process, medians of 20 (the evidence for lm-chain's shared_width=false; results/qwen_draft_int8/README.md).
    SHARED=1 scripts/jobs/quiet.sh python scripts/jobs/draft_width_probe.py bfloat16 int8-weights
SHARED=0 compiles a static graph per width (1, 2, 4); THREADS sets torch's threads (default 2); MODEL another draft
LM of the 0.5B's tokenizer (a registry name or a directory, e.g. a layer-pruned student's final/).
"""
import os
import statistics
import sys

import torch

from draftsmith.eval.latency import measure_forward_latency, mt_bench_context
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.precision import DraftPrecision, with_precision
from draftsmith.models.target import TargetModel
from draftsmith.models.vocab import DraftVocab, with_sliced_head


def main() -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    base = TargetModel.from_pretrained(os.environ.get("MODEL", "qwen2.5-coder-0.5b-instruct"))
    sliced = with_sliced_head(base.model, DraftVocab.load("drafters/qwen2.5-coder_vocab_32768"))
    settings = CompileSettings(capacity=1024, buckets=[1, 2, 4], shared_width=os.environ.get("SHARED", "1") == "1")
    context = mt_bench_context(base.tokenizer, 256)
    for name in sys.argv[1:]:
        lm = TargetModel(with_precision(sliced, DraftPrecision(name)), base.tokenizer, name="draft")
        engine = lm.with_backend(Backend.COMPILED, settings)
        times = {width: measure_forward_latency(engine, context, [width], repeats=20)[width] for width in (1, 2, 4)}
        print(name, {width: round(1000 * statistics.median(t), 1) for width, t in times.items()}, flush=True)


if __name__ == "__main__":
    main()
