"""One OpenVINO GenAI pipeline answering completion requests, run by models/engines/openvino.py in OpenVINO's own
environment (its pins clash with the toolkit's transformers, so this file imports only openvino_genai and the
standard library, never draftsmith).

    <openvino venv>/bin/python openvino_worker.py '<settings JSON>'

Settings: {"model": IR dir, "threads": n, "draft": IR dir | null, "prompt_lookup": bool, "precision": "f32" | "bf16"}. Then one JSON request per
stdin line, {"ids": [...], "max_new_tokens": n, "generation": {GenerationConfig fields}}, answered by one stdout line
in llama.cpp's /completion shape, {"tokens": [...], "timings": {"prompt_ms", "predicted_ms", "predicted_n", "draft_n",
"draft_n_accepted", "target_steps"}}, so a bench reads both engines alike; a failure is answered {"error": "..."}. The first line
written is {"ready": true} once the pipeline is loaded.
"""

from __future__ import annotations

import json
import sys
import time


def load_pipeline(settings: dict):
    import openvino_genai as genai

    device_config = {"INFERENCE_NUM_THREADS": settings["threads"], "INFERENCE_PRECISION_HINT": settings["precision"]}
    extra = {}
    if settings.get("draft"):
        extra["draft_model"] = genai.draft_model(settings["draft"], "CPU", **device_config)
    if settings.get("prompt_lookup"):
        extra["prompt_lookup"] = True
    return genai.LLMPipeline(settings["model"], "CPU", **device_config, **extra)


def speculative_counts(result, tokens: int) -> dict:
    """Drafted and accepted tokens and target steps of one generation. A draft model's counts are OpenVINO's own
    (its extended metrics); prompt lookup has none, so its accepted tokens are the tokens beyond one per target step
    (each step's batch size is in the raw metrics) and its drafted tokens are unknown (0)."""
    steps = len(result.perf_metrics.raw_metrics.m_batch_sizes) or tokens
    metrics = getattr(result, "extended_perf_metrics", None)
    if metrics is not None and hasattr(metrics, "get_num_accepted_tokens"):
        drafted, accepted = int(metrics.get_num_draft_tokens()), int(metrics.get_num_accepted_tokens())
    else:
        drafted, accepted = 0, tokens - steps
    return {"draft_n": drafted, "draft_n_accepted": accepted, "target_steps": steps}


def answer(pipeline, request: dict) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    config = pipeline.get_generation_config()
    config.max_new_tokens = request["max_new_tokens"]
    config.do_sample = False
    for key, value in request.get("generation", {}).items():
        setattr(config, key, value)
    ids = np.array([request["ids"]], dtype=np.int64)
    inputs = genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
    started = time.perf_counter()
    result = pipeline.generate(inputs, config)
    seconds = time.perf_counter() - started
    tokens = [int(t) for t in result.tokens[0]]
    timings = {"prompt_ms": 0.0, "predicted_ms": seconds * 1000, "predicted_n": len(tokens)}
    return {"tokens": tokens, "timings": timings | speculative_counts(result, len(tokens))}


def main() -> None:
    pipeline = load_pipeline(json.loads(sys.argv[1]))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            reply = answer(pipeline, json.loads(line))
        except Exception as error:  # the parent turns it into one line for the user
            reply = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
