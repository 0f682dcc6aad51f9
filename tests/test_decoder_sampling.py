"""Speculative sampling is lossless in distribution: the decoder's first tokens follow the target.

A tiny-vocab model lets us enumerate the exact joint distribution of the first three new tokens
(x1 is drawn from the prefill; x2, x3 go through draft + verification), and compare it with
the decoder's empirical distribution by a chi-square test at a fixed seed budget.
"""

import itertools

import pytest
import torch

from conftest import pooled_chisquare_pvalue, tiny_model
from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.dflash import DFlashDrafter
from draftsmith.eval.decode.drafters.dgf import DGFDrafter
from draftsmith.eval.decode.drafters.lm import LMDrafter
from draftsmith.eval.decode.drafters.medusa import MedusaDrafter
from draftsmith.eval.decode.drafters.ngram import NgramDrafter
from draftsmith.eval.decode.verify import logits_to_probs
from draftsmith.models.dflash import DFlashConfig, DFlashModel
from draftsmith.models.dgf import DGFConfig, DGFModel
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.target import TargetModel
from draftsmith.models.vocab import DraftVocab

VOCAB, NEW, TEMPERATURE, SAMPLES = 5, 3, 0.9, 1500
PROMPT = torch.tensor([[1, 3, 0, 2, 1, 3]])


def exact_joint(model) -> dict[tuple, float]:
    """P(x1, x2, x3 | prompt) under temperature sampling, by enumeration (VOCAB ** NEW sequences)."""
    sequences = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))  # (S, NEW)
    inputs = torch.cat([PROMPT.expand(len(sequences), -1), sequences], dim=1)
    with torch.no_grad():
        logits = model(inputs).logits  # (S, T + NEW, V)
    start = PROMPT.shape[1] - 1
    probs = logits_to_probs(logits[:, start:start + NEW], TEMPERATURE)  # (S, NEW, V)
    step_probs = probs.gather(-1, sequences[..., None])[..., 0].prod(-1)
    return {tuple(seq.tolist()): float(p) for seq, p in zip(sequences, step_probs)}


def make_drafter(kind, model):
    if kind == "chain":  # an unrelated model: q far from p, exercises rejection + residuals
        return LMDrafter(tiny_model("llama", seed=11, vocab_size=VOCAB, num_layers=1), mode="chain", budget=2)
    if kind == "chain-stop":  # the chain's length depends on its own draws: still the target's distribution
        return LMDrafter(tiny_model("llama", seed=11, vocab_size=VOCAB, num_layers=1), mode="chain", budget=3,
                         stop_below=0.5)
    if kind == "tree":  # several children drawn without replacement per node
        return LMDrafter(tiny_model("llama", seed=12, vocab_size=VOCAB, num_layers=1), mode="tree",
                         depth=2, topk=3, beam=2)
    if kind == "medusa":
        torch.manual_seed(13)
        heads = MedusaHeads(MedusaConfig(model.config.hidden_size, VOCAB, num_heads=2))
        return MedusaDrafter(heads, paths=[[0], [1], [0, 0], [0, 1], [1, 0]])
    if kind == "parallel":  # PARD: each position drawn from its own q row, all rows from one forward
        draft = tiny_model("llama", seed=11, vocab_size=VOCAB, num_layers=1)
        draft.config.pard_token = VOCAB - 1
        return LMDrafter(draft, mode="parallel", budget=2)
    if kind == "ngram":  # point-mass proposals, two branches
        return NgramDrafter(max_ngram=2, budget=2, num_branches=2)
    return make_vocab_drafter(kind, model)


DRAFT_VOCAB = DraftVocab.from_ids([0, 1, 3], VOCAB)  # token 2 and 4 are never drafted (q = 0 there)


def make_vocab_drafter(kind, model):
    """Drafters over a reduced draft vocabulary: a sliced LM head, Medusa and DGF heads (own / sliced)."""
    torch.manual_seed(14)
    if kind == "tree-vocab":
        return LMDrafter(tiny_model("llama", seed=12, vocab_size=VOCAB, num_layers=1), mode="tree", depth=2, topk=2,
                         beam=2, vocab=DRAFT_VOCAB)
    if kind.startswith("medusa-vocab"):
        head = kind.rsplit("-", 1)[1]
        heads = MedusaHeads(MedusaConfig(model.config.hidden_size, VOCAB, num_heads=2, draft_vocab_size=3, head=head))
        heads.set_vocab(DRAFT_VOCAB).init_lm_heads(model.get_output_embeddings().weight)
        return MedusaDrafter(heads, paths=[[0], [1], [0, 0], [0, 1], [1, 0]])
    if kind.startswith("dflash"):  # every block position drawn from its own q row, one forward
        config = DFlashConfig.from_target(model.config, num_layers=1, block_size=3, target_layer_ids=[0],
                                          mask_token_id=VOCAB - 1)
        return DFlashDrafter(DFlashModel(config).attach_target(model).eval(),
                             vocab=DRAFT_VOCAB if "vocab" in kind else None, topk=2 if "tree" in kind else 1)
    if kind.startswith("dgf"):
        layers = [1, -1] if "multi_layer" in kind else None
        config = DGFConfig.for_target(model.config, draft_vocab_size=3, head="own" if "own" in kind else "slice",
                                      feature_layers=layers, layer_fusion="linear" if "eagle3" in kind else "gated",
                                      fusion="eagle3" if "eagle3" in kind else "dgf")
        dgf = DGFModel(config).attach_target(model).set_vocab(DRAFT_VOCAB)
        dgf.init_draft_head()
        return DGFDrafter(dgf.eval(), depth=2, topk=2, budget=4, stop_below=0.5 if "stop" in kind else None)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["chain", "chain-stop", "tree", "parallel", "medusa", "ngram", "tree-vocab", "medusa-vocab-own",
                                  "medusa-vocab-slice", "dgf-vocab-slice", "dgf-stop-vocab-slice", "dgf-multi_layer-vocab-own",
                                  "dgf-eagle3-multi_layer-vocab-own", "dflash",
                                  "dflash-vocab", "dflash-tree"])
def test_sampling_matches_target_distribution(kind):
    model = tiny_model("llama", seed=5, vocab_size=VOCAB, num_layers=1, hidden_size=32)
    target = TargetModel(model, tokenizer=None)
    drafter = make_drafter(kind, model)
    exact = exact_joint(model)
    counts = dict.fromkeys(exact, 0)
    accepted_any = 0
    for seed in range(SAMPLES):
        decoder = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=NEW, temperature=TEMPERATURE,
                                                                   seed=seed))
        result = decoder.generate(PROMPT)
        counts[tuple(result.tokens)] += 1
        accepted_any += result.stats.round_tokens > result.stats.verify_forwards
    assert accepted_any > SAMPLES // 10, "drafts were (almost) never accepted: the test would prove little"
    p_value = pooled_chisquare_pvalue(counts, exact, SAMPLES)
    assert p_value > 1e-3, f"{kind}: chi-square p = {p_value:.2e}"
