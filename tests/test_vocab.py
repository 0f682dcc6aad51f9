"""Reduced draft vocabularies (models.vocab): maps, the frequency job, and every drafter kind drafting
over a subset while the decoder's greedy output stays the target's (the chi-square sampling tests with
vocab drafters are in test_decoder_sampling.py, ids containing `vocab`); multi_layer DGF drafters too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_model
from draftsmith.data import draft_vocab
from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.dgf import DGFDrafter, load_dgf_drafter
from draftsmith.eval.decode.drafters.lm import LMDrafter
from draftsmith.eval.decode.drafters.medusa import MedusaDrafter, load_medusa_drafter
from draftsmith.models.artifacts import DGF_WEIGHTS, float_state, read_manifest, save_dgf, save_medusa, target_block
from draftsmith.models.dgf import DGFConfig, DGFModel
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.precision import DraftPrecision, with_precision
from draftsmith.models.target import TargetModel
from draftsmith.models.tiny import TinyTokenizer
from draftsmith.models.vocab import VOCAB_FILE, DraftVocab, with_sliced_head

SUBSET = list(range(0, 96, 2)) + [1, 3, 5]  # 51 of the 96 tiny tokens
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", seed=21, num_layers=2)
    return TargetModel(model, tokenizer=TinyTokenizer(96), name="tiny"), DraftVocab.from_ids(SUBSET, 96)


def test_vocab_maps_round_trip_and_eagle3_layout(tmp_path):
    vocab = DraftVocab.from_ids([7, 3, 3, 90, 0], 96)
    assert vocab.draft_to_target.tolist() == [0, 3, 7, 90] and vocab.size == 4
    assert vocab.to_draft(torch.tensor([7, 8])).tolist() == [2, -1]
    assert vocab.to_target(torch.tensor([3, 0])).tolist() == [90, 0]
    rows = vocab.scatter(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    assert rows.shape == (1, 96) and rows[0, 90] == pytest.approx(0.4) and rows.sum() == pytest.approx(1.0)
    d2t, t2d = vocab.eagle3_maps()
    assert (torch.arange(4) + d2t).tolist() == [0, 3, 7, 90] and int(t2d.sum()) == 4 and bool(t2d[90])
    vocab.save(tmp_path)
    again = DraftVocab.load(tmp_path)
    assert torch.equal(again.draft_to_target, vocab.draft_to_target) and again.digest() == vocab.digest()
    with pytest.raises(ValueError, match="ascending"):
        DraftVocab(torch.tensor([3, 1]), 96)
    with pytest.raises(ValueError, match="no draft vocabulary"):
        DraftVocab.load(tmp_path / "missing")


def test_vocab_ranking_keeps_specials_and_reports_coverage():
    from collections import Counter

    counts = Counter({5: 10, 9: 7, 2: 7, 40: 1})
    vocab = draft_vocab.top_tokens(counts, 3, forced=[95], target_size=96)
    assert vocab.draft_to_target.tolist() == [2, 5, 95]  # the special token, then by count (ties: lower id)
    assert draft_vocab.coverage(counts, vocab) == pytest.approx(17 / 25)
    padded = draft_vocab.top_tokens(Counter({4: 1}), 3, forced=[], target_size=96)
    assert padded.draft_to_target.tolist() == [0, 1, 4]  # a corpus with fewer tokens: filled with low ids


def test_vocab_job_on_a_real_tokenizer(tmp_path, smol_tokenizer):
    data = tmp_path / "conv.jsonl"
    rows = [{"id": str(i), "source": "t", "messages": [{"role": "user", "content": "Count."},
                                                      {"role": "assistant", "content": f"one two three {i}"}]}
            for i in range(6)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "vocab"
    report = draft_vocab.main([f"sources=conversations:{data}", "size=64", "report_sizes=16 32", f"output={out}"])
    vocab = DraftVocab.load(out)
    assert vocab.size == 64 and vocab.target_size == 49152
    assert smol_tokenizer.eos_token_id in vocab.draft_to_target.tolist()
    assert report["coverage"][f"conversations:{data}"]["64"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="exists: pass --overwrite"):
        draft_vocab.main([f"sources=conversations:{data}", f"output={out}"])


def greedy_is_kept(target: TargetModel, drafter, seeds=range(3), new_tokens: int = 20) -> float:
    """Every drafted run equals plain greedy; returns the best tau seen."""
    best = 0.0
    for seed in seeds:
        prompt = torch.randint(0, 96, (1, 6 + seed), generator=torch.Generator().manual_seed(seed))
        prompt = torch.cat([prompt, prompt], 1)  # repetition: drafts get accepted
        plain = SpeculativeDecoder(target, None, DecodeConfig(max_new_tokens=new_tokens)).generate(prompt).tokens
        result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=new_tokens)).generate(prompt)
        assert result.tokens == plain
        best = max(best, result.stats.tau)
    return best


def test_lm_drafter_with_a_sliced_vocab_head_is_lossless(tiny):
    target, vocab = tiny
    sliced = with_sliced_head(target.model, vocab)
    assert sliced.get_output_embeddings().weight.shape == (vocab.size, 48)
    assert target.model.get_output_embeddings().weight.shape == (96, 48)  # the original is untouched
    for mode, extra in (("chain", {"budget": 4}), ("tree", {"depth": 3, "topk": 2, "budget": 6})):
        drafter = LMDrafter(target.model, mode=mode, vocab=vocab, **extra)  # the target drafting for itself
        assert greedy_is_kept(target, drafter) > 1.0
        tree = drafter.propose(5, torch.tensor([1, 2, 3, 4, 5]), None, None)
        assert set(tree.tokens.tolist()) <= set(vocab.draft_to_target.tolist())


@pytest.mark.parametrize("head", ["own", "slice"])
def test_medusa_vocab_heads_are_lossless_and_saved_with_their_maps(tiny, head, tmp_path):
    target, vocab = tiny
    torch.manual_seed(3)
    heads = MedusaHeads(MedusaConfig(48, 96, num_heads=3, draft_vocab_size=vocab.size, head=head)).set_vocab(vocab)
    heads.init_lm_heads(target.model.get_output_embeddings().weight)
    assert heads(torch.randn(2, 48)).shape == (3, 2, vocab.size)
    drafter = MedusaDrafter(heads, paths=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    greedy_is_kept(target, drafter)
    save_medusa(heads, tmp_path, target_block(target, "tiny", [-1], "float32"))
    manifest = read_manifest(tmp_path, "draftsmith.medusa/1")
    assert manifest["draft_vocab"]["size"] == vocab.size and (tmp_path / VOCAB_FILE).is_file()
    loaded = load_medusa_drafter(tmp_path, target)
    assert torch.equal(loaded.vocab.draft_to_target, vocab.draft_to_target)
    hidden = torch.randn(4, 48)
    torch.testing.assert_close(loaded.heads(hidden), heads(hidden))
    own_params = sum(p.numel() for p in heads.parameters())
    assert own_params == 3 * (48 * 48 + 48) + (3 * 48 * vocab.size if head == "own" else 0)


def make_dgf(target: TargetModel, vocab: DraftVocab | None, **kwargs) -> DGFModel:
    torch.manual_seed(5)
    size = None if vocab is None else vocab.size
    config = DGFConfig.for_target(target.model.config, draft_vocab_size=size, **kwargs)
    model = DGFModel(config).attach_target(target.model)
    if vocab is not None:
        model.set_vocab(vocab).init_draft_head()
    return model.eval()


@pytest.mark.parametrize("head,layers,layer_fusion,fusion", [
    ("slice", None, "linear", "dgf"), ("own", None, "linear", "dgf"), ("slice", [1, 2, -1], "linear", "dgf"),
    ("own", [1, -1], "gated", "dgf"), ("own", [1, 2], "linear", "eagle3"), ("slice", [1, 2], "linear", "eagle3")],
    ids=["vocab-slice", "vocab-own", "multi_layer-linear-vocab", "multi_layer-gated-vocab", "eagle3-multi_layer-vocab-own",
         "eagle3-multi_layer-vocab-slice"])
def test_dgf_vocab_and_multi_layer_drafters_are_lossless_and_reload(tiny, head, layers, layer_fusion, fusion, tmp_path):
    target, vocab = tiny
    model = make_dgf(target, vocab, head=head, feature_layers=layers, layer_fusion=layer_fusion, fusion=fusion)
    assert model.logits(torch.randn(3, 48)).shape == (3, vocab.size)
    drafter = DGFDrafter(model, depth=3, topk=3, budget=7)
    assert drafter.hidden_layers == tuple(layers or [-1])
    greedy_is_kept(target, drafter)
    save_dgf(model, tmp_path, target_block(target, "tiny", layers or [-1], "float32"))
    manifest = read_manifest(tmp_path, "draftsmith.dgf/1")
    assert manifest["draft_vocab"]["sha256"] == vocab.digest() and manifest["drafter"]["head"] == head
    loaded = load_dgf_drafter(tmp_path, target, depth=3, topk=3, budget=7)
    x, ids = torch.randn(1, 5, 48), torch.randint(0, 96, (1, 5))
    torch.testing.assert_close(loaded.model.logits(loaded.model(x, ids)), model.logits(model(x, ids)))


def test_bfloat16_dgf_export_keeps_the_vocabulary_indices_exact(tiny, tmp_path):
    """bfloat16 holds integers exactly only up to 256 (Qwen/SmolLM2 ids go to 49151 and beyond): the draft
    vocabulary's index buffer is stored as integers, the weights in bfloat16."""
    target, vocab = tiny
    model = make_dgf(target, vocab, head="slice")
    assert float_state(_buffer_module(torch.tensor([49151])))["ids"].tolist() == [49151]
    save_dgf(model, tmp_path, target_block(target, "tiny", [-1], "float32"), dtype=torch.bfloat16)
    stored = load_file(str(tmp_path / DGF_WEIGHTS))
    assert stored["draft_to_target"].dtype == torch.int64
    assert torch.equal(stored["draft_to_target"], vocab.draft_to_target)
    assert {t.dtype for name, t in stored.items() if name != "draft_to_target"} == {torch.bfloat16}
    load_dgf_drafter(tmp_path, target, depth=2, topk=1, budget=2)


def _buffer_module(ids: torch.Tensor) -> torch.nn.Module:
    module = torch.nn.Module()
    module.register_buffer("ids", ids)
    return module


def test_multi_layer_fusion_reads_every_layer(tiny):
    target, _ = tiny
    for fusion in ("linear", "gated"):
        model = make_dgf(target, None, feature_layers=[1, 2, -1], layer_fusion=fusion)
        layers = torch.randn(4, 3, 48, requires_grad=True)
        model.fuse_layers(layers).sum().backward()
        assert all(float(layers.grad[:, i].abs().sum()) > 0 for i in range(3))  # each layer reaches the output
    with pytest.raises(ValueError, match="needs head 'slice' or 'own'"):
        DGFConfig.for_target(target.model.config, draft_vocab_size=10)


def test_vocab_mismatch_is_refused(tiny):
    target, vocab = tiny
    with pytest.raises(ValueError, match="does not fit"):
        MedusaHeads(MedusaConfig(48, 96, draft_vocab_size=10, head="slice")).set_vocab(vocab)
    with pytest.raises(ValueError, match="LM head has 50"):
        with_sliced_head(tiny_model("llama", vocab_size=50), vocab)


def test_ablation_table_reads_bench_and_drafter_and_measures_coverage_on_outputs(tiny, tmp_path):
    from draftsmith.scripts import ablation_table

    target, vocab = tiny
    model = make_dgf(target, vocab, head="slice")
    final = tmp_path / "v8k" / "final"
    save_dgf(model, final, target_block(target, "tiny", [-1], "float32"), training={"steps": 5},
             eval={"after": {"eval/tau": 1.5, "eval/step0_top1": 0.4}})
    inside, outside = int(vocab.draft_to_target[0]), next(t for t in range(96) if t not in set(
        vocab.draft_to_target.tolist()))
    label = f"dgf:path={final}"
    results = {"suites": ["gsm8k"], "machine": {"cpu": "test"},
               "per_prompt": [{"suite": "gsm8k", "plain": {"tokens": [inside, inside, inside, outside]}}],
               "summary": {"plain": {}, label: {"by_suite": {"gsm8k": {"tau": 2.0, "draft_ms_per_round": 3.0,
                                                                      "speedup": 0.9, "speedup_compiled": 0.5}},
                                                "draft_step_ratio": 0.2}}}
    (tmp_path / "bench.json").write_text(json.dumps(results))
    assert ablation_table.main([str(tmp_path / "bench.json"), "--out", str(tmp_path / "t.md")]) == 0
    row = json.loads((tmp_path / "t.json").read_text())["rows"][0]
    assert row["variant"] == "v8k" and row["vocab"] == vocab.size and row["train_tau"] == 1.5
    assert row["gsm8k"]["coverage"] == 0.75 and row["gsm8k"]["tau"] == 2.0
    assert "| v8k |" in (tmp_path / "t.md").read_text()


def test_committed_qwen_draft_vocabulary_loads_with_the_special_tokens():
    """The Qwen pair's committed draft vocabulary (scripts/jobs/vocab_qwen.sh) is a 32k subset of the 151,936
    target ids that keeps the chat template's end-of-turn tokens, so a sliced drafter can end an answer."""
    vocab = DraftVocab.load(REPO / "drafters" / "qwen2.5-coder_vocab_32768")
    assert (vocab.size, vocab.target_size) == (32768, 151936)
    for end_of_turn in (151643, 151645):  # <|endoftext|>, <|im_end|>
        assert int(vocab.to_draft(torch.tensor([end_of_turn]))[0]) >= 0


def test_an_int8_weight_draft_lm_with_a_sliced_head_is_lossless(tiny):
    """The bench's order (slice the head, then the precision): the int8 head keeps the draft vocabulary's size."""
    target, vocab = tiny
    draft = with_precision(with_sliced_head(target.model, vocab), DraftPrecision.INT8_WEIGHTS)
    drafter = LMDrafter(TargetModel(draft, tokenizer=target.tokenizer, name="int8"), mode="chain", budget=4,
                        vocab=vocab)
    assert greedy_is_kept(target, drafter) > 1.0
