"""Shared fixtures: tiny random HF models built in-process (no files, no network)."""

from __future__ import annotations

import json
import os

# before transformers and huggingface_hub are imported: they read these once, at import
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from draftsmith.models.artifacts import ACCURACY_FILE, CONFIG_FILE, MANIFEST_FILE
from draftsmith.models.artifacts import MEDUSA_FORMAT as MANIFEST_FORMAT
from draftsmith.models.artifacts import MEDUSA_WEIGHTS as HEADS_FILE
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(1)  # tiny models: threads only add sync overhead (and thrash under load)

TINY_VOCAB = 96


def tiny_config(family: str = "llama", vocab_size: int = TINY_VOCAB, hidden_size: int = 48,
                num_layers: int = 2, eos_token_id: int | None = None):
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.2, eos_token_id=eos_token_id,
                  bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(family)


def tiny_model(family: str = "llama", seed: int = 0, **kwargs):
    """A random tiny causal LM in fp32 eval mode, sdpa attention."""
    torch.manual_seed(seed)
    config = tiny_config(family, **kwargs)
    config._attn_implementation = "sdpa"
    cls = LlamaForCausalLM if family == "llama" else Qwen2ForCausalLM
    model = cls(config).eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.eos_token_id if config.eos_token_id is not None else 0
    return model


def repetitive_prompt(seed: int, period: int = 6, tail: int = 3) -> torch.Tensor:
    """(1, 2 * period + tail) token ids: a random run repeated once, then a random tail (something for n-gram
    lookup to find)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 96, (period,), generator=gen)
    return torch.cat([base, base, torch.randint(0, 96, (tail,), generator=gen)])[None]


def pooled_chisquare_pvalue(counts: dict, exact: dict, samples: int) -> float:
    """Chi-square p-value of sampled `counts` against the `exact` probabilities of the same keys, with the cells
    expected fewer than 5 times pooled into one (so the approximation holds) and the expectation rescaled to the
    samples (exact probabilities sum to 1 only up to float rounding)."""
    from scipy.stats import chisquare

    observed, expected, pool_observed, pool_expected = [], [], 0, 0.0
    for key in sorted(exact, key=exact.get, reverse=True):
        if exact[key] * samples >= 5:
            observed.append(counts[key])
            expected.append(exact[key] * samples)
        else:
            pool_observed, pool_expected = pool_observed + counts[key], pool_expected + exact[key] * samples
    observed.append(pool_observed)
    expected.append(pool_expected)
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module whose tests may change it (a CLI run with threads=2): tiny matmuls run
    ~10x faster on one thread when the 2 cores are shared. Use: pytestmark = pytest.mark.usefixtures("one_thread")."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["llama", "qwen2"])
def family(request):
    return request.param


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The real SmolLM2 tokenizer (chat template included) from the registry cache; skip if absent."""
    from draftsmith.models.registry import is_fetched, resolve_model_path
    from transformers import AutoTokenizer

    if not is_fetched("smollm2-135m-instruct"):
        pytest.skip("smollm2-135m-instruct not converted in the registry cache (scripts/fetch_models.py)")
    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))


def tiny_target_for(tokenizer, seed: int):
    """A tiny random Llama whose vocab matches `tokenizer` (ids decode to real text), as a target."""
    from types import SimpleNamespace

    model = tiny_model("llama", seed=seed, vocab_size=len(tokenizer), hidden_size=32,
                       eos_token_id=tokenizer.eos_token_id)
    return SimpleNamespace(model=model, tokenizer=tokenizer)


def build_spec(spec: str, target, draft=None):
    """The drafter a bench method spec builds (DrafterMethod), else the method (a policy)."""
    from draftsmith.eval.decode.decoder import DrafterMethod
    from draftsmith.eval.bench.methods import BuildContext, build_method

    method = build_method(spec, BuildContext(target, draft))
    return method.drafter if isinstance(method, DrafterMethod) and method.drafter is not None else method


def write_medusa_final(path, heads, adapter=None):
    """A train/medusa.py-style final/ directory holding `heads` (manifest for a tiny target)."""
    config = heads.config
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(path / HEADS_FILE))
    (path / CONFIG_FILE).write_text(json.dumps(config.to_dict()))
    (path / MANIFEST_FILE).write_text(json.dumps({
        "format": MANIFEST_FORMAT, "method": "medusa-1", "target_adapter": adapter,
        "target": {"name": "tiny-target", "model_type": "llama", "hidden_size": config.hidden_size,
                   "vocab_size": config.vocab_size, "num_hidden_layers": 2, "vocab_fingerprint": "abc",
                   "hidden_layer": -1},
        "heads": {"file": HEADS_FILE, "config": CONFIG_FILE}}))
    (path / ACCURACY_FILE).write_text(json.dumps({"rank_accuracy": [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]],
                                                  "top1": [0.6, 0.4, 0.3]}))
    return heads


def make_adapter(student, directory, base: str, pard_token: int | None = 5):
    """A LoRA adapter (random, nonzero) on `student` as train/distill.py writes it: PEFT files + sidecar."""
    import copy

    from peft import LoraConfig, get_peft_model

    from draftsmith.train.student_parts import write_adapter

    model = copy.deepcopy(student)
    if pard_token is not None:
        model.config.pard_token = pard_token
    torch.manual_seed(3)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))
    write_adapter(peft_model, directory, torch.float32, base)
    return peft_model
