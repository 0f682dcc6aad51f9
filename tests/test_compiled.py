"""The compiled backend on tiny models: static-cache forwards and KV commit equal the eager engine's,
every drafter on the compiled path reproduces compiled plain greedy token for token, speculative
sampling keeps the target's distribution, packages are cached on disk. (Real models: test_real_models.py,
`slow`.)"""

from __future__ import annotations

import pytest
import torch

from conftest import repetitive_prompt, tiny_model
from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.base import Sampling
from draftsmith.eval.decode.drafters.dgf import DGFDrafter
from draftsmith.eval.decode.drafters.lm import LMDrafter
from draftsmith.eval.decode.drafters.medusa import MedusaDrafter
from draftsmith.eval.decode.drafters.ngram import NgramDrafter
from draftsmith.eval.decode.tree import DraftTree, tree_attention_mask, tree_position_ids
from draftsmith.models.compiled import CompiledDGFEngine, CompiledEngine, CompileSettings, Graph, bucket_for
from draftsmith.models.dgf import DGFConfig, DGFModel
from draftsmith.models.kernels import WeightPrecision
from draftsmith.models.medusa import InvariantMedusaHeads, MedusaConfig, MedusaHeads
from draftsmith.models.target import TargetModel
from draftsmith.models.vocab import DraftVocab

ONE = CompileSettings(buckets=[1], capacity=64, autotune=False)
FAST = CompileSettings(buckets=[1, 8], capacity=128, autotune=False)


@pytest.fixture(scope="module")
def compiled_pair():
    """(eager target, compiled target, compiled draft) of tiny Llamas; packages built once per machine
    (without GEMM autotuning, which only changes speed: the autotuned build is covered by the slow tests)."""
    torch.manual_seed(0)
    model = tiny_model("llama", seed=3, num_layers=2)
    eager = TargetModel(model, tokenizer=None)
    compiled = TargetModel(model, None, engine=CompiledEngine(model, FAST))
    small = tiny_model("llama", seed=4, num_layers=1)
    draft = TargetModel(small, None, engine=CompiledEngine(small, FAST))
    compiled.engine.prepare()
    draft.engine.prepare()
    return eager, compiled, draft


def test_compiled_bucket_choice():
    assert [bucket_for(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="largest bucket"):
        bucket_for(9, (1, 2, 4, 8))


def test_compiled_graph_choice_shared_and_padded():
    model = tiny_model("llama", seed=3, num_layers=1)
    shared = CompiledEngine(model, CompileSettings(buckets=[1, 4, 16], capacity=64, autotune=False))
    assert {shared.graph_for(n) for n in (1, 2, 16)} == {Graph(16, shared=True)}  # one graph, one weight copy
    assert [shared.graph_for(n).runs_at(n) for n in (1, 3, 16)] == [1, 3, 16]  # exact widths, nothing padded
    padded = CompiledEngine(model, CompileSettings(buckets=[1, 4, 16], capacity=64, autotune=False,
                                                   shared_width=False))
    assert [padded.graph_for(n).runs_at(n) for n in (1, 3, 5)] == [1, 4, 16]
    assert shared.graph_groups((1, 2, 4, 8)) == [(1, 2, 4, 8)]  # what eval.latency release=true measures together
    assert padded.graph_groups((1, 2, 4, 8)) == [(1,), (2, 4), (8,)]


def additive_mask_reference(capacity, dtype, allowed, past, n, bucket):
    """The static mask spelled out: a bool mask of what each row sees, then 0 there and the dtype's minimum
    elsewhere (padded rows see their own slot only)."""
    sees = torch.zeros(bucket, capacity, dtype=torch.bool)
    sees[:n, :past + n] = torch.ones(n, past + n, dtype=torch.bool).tril(past) if allowed is None else allowed
    pad = torch.arange(n, bucket)
    sees[pad, past + pad] = True
    return torch.zeros(sees.shape, dtype=dtype).masked_fill_(~sees, torch.finfo(dtype).min)[None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_masks_are_bit_for_bit_the_spelled_out_ones(dtype):
    """The causal mask cut from a precomputed window and the allowed masks filled in place are the same bits as
    the mask spelled out (the kernels' outputs depend on them), each in its own contiguous storage."""
    model = tiny_model("llama", seed=3, num_layers=1)
    engine = CompiledEngine(model.to(dtype), CompileSettings(buckets=[1, 4, 8], capacity=40, autotune=False))
    generator = torch.Generator().manual_seed(0)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for past, n, padding in [(0, 1, 0), (5, 1, 0), (31, 1, 0), (0, 8, 0), (31, 8, 0), (3, 3, 1), (12, 2, 2)]:
        for allowed in (None, torch.rand(n, past + n, generator=generator) > 0.5):
            mask = engine.static_mask(allowed, past, n, n + padding)
            expected = additive_mask_reference(40, dtype, allowed, past, n, n + padding)
            assert mask.is_contiguous() and torch.equal(mask.view(bits), expected.view(bits)), (past, n, padding)
    first = engine.static_mask(None, 5, 1, 1)
    first.fill_(0)  # a caller's mask is its own: the window it came from is unchanged
    assert torch.equal(engine.static_mask(None, 5, 1, 1).view(bits), additive_mask_reference(40, dtype, None, 5, 1,
                                                                                             1).view(bits))


def test_compiled_padded_graphs_match_eager(tmp_path):
    """shared_width=false: one graph per bucket, a 5-token tree padded to 8, prompt chunks of 8."""
    model = tiny_model("llama", seed=3, num_layers=1)
    eager = TargetModel(model, tokenizer=None)
    settings = CompileSettings(buckets=[1, 8], capacity=64, autotune=False, shared_width=False)
    compiled = TargetModel(model, None, engine=CompiledEngine(model, settings, cache_dir=tmp_path))
    prompt = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(1))
    caches = [eager.new_cache(), compiled.new_cache(40)]
    outs = [lm.forward(prompt, cache) for lm, cache in zip((eager, compiled), caches)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
    tree = DraftTree.from_parents(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 0]))
    allowed = tree_attention_mask(tree.parents, prompt.shape[1])
    positions = tree_position_ids(tree.depths, prompt.shape[1])
    ids = torch.tensor([[4, 5, 6, 7, 8]])
    outs = [lm.forward(ids, cache, positions, allowed) for lm, cache in zip((eager, compiled), caches)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
    assert set(compiled.engine.runners) == {Graph(8)}  # 11 = 8 + 3 padded, then 5 padded


def test_compiled_forward_and_commit_match_eager(compiled_pair):
    eager, compiled, _ = compiled_pair
    prompt = torch.randint(0, 96, (1, 19), generator=torch.Generator().manual_seed(1))
    caches = [eager.new_cache(), compiled.new_cache(64)]
    outs = [lm.forward(prompt, cache, hidden_layers=(-1,)) for lm, cache in zip((eager, compiled), caches)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)  # chunked prefill (8 + 8 + 3)
    torch.testing.assert_close(outs[1].hidden[-1], outs[0].hidden[-1], atol=1e-4, rtol=1e-4)
    tree = DraftTree.from_parents(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 0, 2]))
    past = prompt.shape[1]
    allowed, positions = tree_attention_mask(tree.parents, past), tree_position_ids(tree.depths, past)
    ids = torch.tensor([[4, 5, 6, 7, 8, 9]])
    outs = [lm.forward(ids, cache, positions, allowed) for lm, cache in zip((eager, compiled), caches)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)  # a tree of 6, shared graph
    keep = torch.cat([torch.arange(past), past + torch.tensor([0, 1, 3, 5])])  # root, node 0, node 2, node 4
    assert caches[1].stacked is not None  # the commit moves every layer's slots through one view
    for lm, cache in zip((eager, compiled), caches):
        lm.commit(cache, keep)
        assert lm.cache_length(cache) == past + 4
    nxt = torch.tensor([[11, 12]])
    outs = [lm.forward(nxt, cache) for lm, cache in zip((eager, compiled), caches)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)  # the committed path is right
    outs = [lm.forward(torch.tensor([[13]]), cache) for lm, cache in zip((eager, compiled), caches)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)  # one token, the same graph


def _drafters(compiled, draft):
    torch.manual_seed(7)
    heads = MedusaHeads(MedusaConfig(48, 96, num_heads=3))
    heads.init_lm_heads(compiled.model.lm_head.weight)
    paths = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    return {"lm-chain": LMDrafter(draft, mode="chain", budget=3),
            "lm-tree": LMDrafter(draft, mode="tree", depth=2, topk=2, budget=6),
            "ngram": NgramDrafter(max_ngram=2, budget=4, num_branches=2), "medusa": MedusaDrafter(heads, paths=paths),
            "medusa-int8": MedusaDrafter(heads, paths=paths, runs=InvariantMedusaHeads(heads, WeightPrecision.INT8))}


@pytest.mark.parametrize("seed", range(2))
def test_compiled_greedy_equals_compiled_plain(compiled_pair, seed):
    eager, compiled, draft = compiled_pair
    prompt = repetitive_prompt(seed, period=5)
    config = DecodeConfig(max_new_tokens=20, budget_limit=7)
    plain = SpeculativeDecoder(compiled, None, config).generate(prompt).tokens
    hf = eager.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                              do_sample=False)[0, prompt.shape[1]:].tolist()
    assert plain == hf  # tiny fp32 model: no near-ties, the compiled plain run equals HF eager greedy
    for name, drafter in _drafters(compiled, draft).items():
        result = SpeculativeDecoder(compiled, drafter, config).generate(prompt)
        assert result.tokens == plain, name
        assert result.stats.verify_forwards >= 1


def test_compiled_sampling_matches_target_distribution(compiled_pair):
    from scipy.stats import chisquare

    _, compiled, draft = compiled_pair
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    logp = compiled_pair[0].model(prompt).logits[0, -1].float().log_softmax(-1)  # the first token's distribution
    probs = logp.exp()
    top = probs.topk(4).indices.tolist()
    counts = {t: 0 for t in top + [-1]}
    samples = 400
    drafter = LMDrafter(draft, mode="chain", budget=2)
    for seed in range(samples):
        config = DecodeConfig(max_new_tokens=2, temperature=1.0, seed=seed, budget_limit=7)
        token = SpeculativeDecoder(compiled, drafter, config).generate(prompt).tokens[1]  # drawn by verification
        counts[token if token in counts else -1] += 1
    # the second token's distribution depends on the first; compare against the exact marginal
    expected = _second_token_marginal(compiled_pair[0].model, prompt, top)
    observed = [counts[t] for t in top + [-1]]
    assert chisquare(observed, [e * samples for e in expected]).pvalue > 1e-3


def _second_token_marginal(model, prompt, tokens: list[int]) -> list[float]:
    """P(second new token = t) for t in tokens (+ the rest), summing over the first token."""
    with torch.no_grad():
        first = model(prompt).logits[0, -1].float().softmax(-1)  # (V,)
        rows = torch.cat([prompt.expand(first.numel(), -1), torch.arange(first.numel())[:, None]], 1)
        second = model(rows).logits[:, -1].float().softmax(-1)  # (V, V)
        marginal = first @ second
    picked = [float(marginal[t]) for t in tokens]
    return picked + [max(0.0, 1.0 - sum(picked))]


def test_compiled_packages_are_cached_on_disk(tmp_path):
    model = tiny_model("qwen2", seed=9, num_layers=1)
    first = CompiledEngine(model, ONE, cache_dir=tmp_path)
    first.prepare()
    assert set(first.compile_s) == {"bucket_1"} and (first.directory / "bucket_1.pt2").is_file()
    conditions = first.build_conditions()  # how busy the machine was while autotuning, for the bench report
    assert conditions["cpu_count"] >= 1 and conditions["load_average_1min"] >= 0 and conditions["built"]
    second = CompiledEngine(model, ONE, cache_dir=tmp_path)
    second.prepare()
    assert second.compile_s == {} and second.load_s["bucket_1"] < 30  # loaded, not compiled again
    other = CompiledEngine(tiny_model("qwen2", seed=10, num_layers=1), ONE, cache_dir=tmp_path)
    assert other.directory != first.directory  # other weights, other packages


def test_loaded_packages_unpack_under_the_cache_and_dead_runs_are_swept(tmp_path, monkeypatch):
    """The loader unpacks each package (weights included) to a temporary folder a killed run never removes:
    ours live under $DRAFTSMITH_CACHE/aoti-extract/<pid>, and the next load removes those of dead processes."""
    import os
    import subprocess
    import sys

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "cache" / "aoti-extract" / gone.stdout.strip()
    stale.mkdir(parents=True)
    (stale / "weights.bin").write_bytes(b"x" * 1024)
    engine = CompiledEngine(tiny_model("qwen2", seed=9, num_layers=1), ONE, cache_dir=tmp_path / "packages")
    engine.prepare()
    mine = tmp_path / "cache" / "aoti-extract" / str(os.getpid())
    assert not stale.exists() and any(mine.iterdir()), "the loader did not unpack under our folder"


def test_compiled_dgf_drafter_matches_eager_and_is_lossless(compiled_pair):
    eager, compiled, _ = compiled_pair
    torch.manual_seed(11)
    dgf = DGFModel(DGFConfig.for_target(eager.model.config, num_blocks=2)).attach_target(eager.model).eval()
    engine = CompiledDGFEngine(dgf, FAST)
    engine.prepare()
    context = torch.randint(0, 96, (14,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        features = eager.model(context[None, :-1], output_hidden_states=True).hidden_states[-1][0]
    trees = []
    for drafter in (DGFDrafter(dgf, depth=3, topk=3, budget=7), DGFDrafter(dgf, depth=3, topk=3, budget=7,
                                                                          engine=engine)):
        drafter.begin(context)
        drafter.observe(context[:-1], {-1: features})
        trees.append(drafter.propose(int(context[-1]), context, None, None))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)
    prompt = context[None, :9]
    config = DecodeConfig(max_new_tokens=20, budget_limit=7)
    plain = SpeculativeDecoder(compiled, None, config).generate(prompt).tokens
    drafter = DGFDrafter(dgf, depth=3, topk=3, budget=7, engine=engine)
    assert SpeculativeDecoder(compiled, drafter, config).generate(prompt).tokens == plain


def test_a_float32_drafters_greedy_chain_reads_its_greedy_head(compiled_pair):
    """A greedy chain without thresholds reads only each step's argmax: on the compiled engine a float32 drafter's
    sliced head answers it from its greedy head's int8 rows (the exact argmax), drafting the chain the eager drafter's
    logits give, every context; with stop_below (its scores read) the chain comes from the logits; lossless."""
    eager, compiled, _ = compiled_pair
    torch.manual_seed(12)
    vocab = DraftVocab.from_ids(range(0, 96, 2), 96)
    config = DGFConfig.for_target(eager.model.config, num_blocks=1, draft_vocab_size=vocab.size, head="slice")
    dgf = DGFModel(config).attach_target(eager.model).set_vocab(vocab).eval()
    engine = CompiledDGFEngine(dgf, FAST)
    engine.prepare()
    assert engine.greedy_head is not None
    for seed in range(4):
        context = torch.randint(0, 96, (10 + seed,), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            features = eager.model(context[None, :-1], output_hidden_states=True).hidden_states[-1][0]
        trees = []
        for drafter in (DGFDrafter(dgf, depth=4, topk=1, budget=4), DGFDrafter(dgf, depth=4, topk=1, budget=4,
                                                                              engine=engine)):
            assert drafter.reads_argmax_only(None) and not drafter.reads_argmax_only(Sampling(1.0))
            drafter.begin(context)
            drafter.observe(context[:-1], {-1: features})
            trees.append(drafter.propose(int(context[-1]), context, None, None))
        assert torch.equal(trees[0].tokens, trees[1].tokens) and trees[1].size == 4
    assert not DGFDrafter(dgf, depth=4, topk=1, budget=4, engine=engine, stop_below=0.1).reads_argmax_only(None)
    prompt = context[None, :9]
    decode = DecodeConfig(max_new_tokens=20, budget_limit=7)
    plain = SpeculativeDecoder(compiled, None, decode).generate(prompt).tokens
    drafter = DGFDrafter(dgf, depth=3, topk=1, budget=3, engine=engine)
    assert SpeculativeDecoder(compiled, drafter, decode).generate(prompt).tokens == plain


def _conversation(first: torch.Tensor, answer: list[int], followup: list[int]) -> torch.Tensor:
    return torch.cat([first[0], torch.tensor(answer + followup)])[None]


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_prefix_cache_reuses_the_last_request_and_changes_no_output(compiled_pair, engine):
    """A conversation's second turn starts from the first turn's cache (prompt + answer), with the drafter's hidden
    states; the outputs are those of a fresh prefill. On the invariant kernels the cache's slots are bit for bit a
    fresh prefill's too."""
    eager, compiled, _ = compiled_pair
    target = compiled if engine == "compiled" else eager
    torch.manual_seed(11)
    dgf = DGFModel(DGFConfig.for_target(eager.model.config, num_blocks=2)).attach_target(eager.model).eval()
    config = DecodeConfig(max_new_tokens=12, budget_limit=7)
    first = repetitive_prompt(2, period=5)
    cached = SpeculativeDecoder(target, DGFDrafter(dgf, depth=3, topk=3, budget=7), config)
    answer = cached.generate(first)
    assert answer.stats.reused_tokens == 0
    second = _conversation(first, answer.tokens, [7, 8, 9])
    turn = cached.generate(second)
    assert first.shape[1] <= turn.stats.reused_tokens <= first.shape[1] + len(answer.tokens) - 1
    fresh = SpeculativeDecoder(target, DGFDrafter(dgf, depth=3, topk=3, budget=7), config)
    alone = fresh.generate(second)
    assert alone.stats.reused_tokens == 0 and turn.tokens == alone.tokens
    plain = SpeculativeDecoder(target, None, DecodeConfig(max_new_tokens=12, prefix_cache=False)).generate(second)
    assert plain.tokens == turn.tokens and plain.stats.reused_tokens == 0
    if engine == "compiled":
        held = compiled.cache_length(cached.prompt_cache.cache)
        assert held == compiled.cache_length(fresh.prompt_cache.cache)
        for reused, prefilled in zip(cached.prompt_cache.cache.tensors, fresh.prompt_cache.cache.tensors):
            assert torch.equal(reused[:, :, :held], prefilled[:, :, :held])
        for layer, states in cached.prompt_cache.hidden.items():
            assert torch.equal(states, fresh.prompt_cache.hidden[layer])


def test_prefix_cache_starts_fresh_where_nothing_is_shared_or_the_cache_is_too_small(compiled_pair):
    _, compiled, _ = compiled_pair
    decoder = SpeculativeDecoder(compiled, None, DecodeConfig(max_new_tokens=8))
    first = repetitive_prompt(0, period=5)
    decoder.generate(first)
    other = (first + 1) % 96
    assert decoder.generate(other).stats.reused_tokens == 0  # no common first token
    assert decoder.generate(other).stats.reused_tokens == other.shape[1] - 1  # the same prompt: all but its last
    assert compiled.fits(16) and not compiled.fits(128 - 8 + 1)  # FAST: capacity 128, buckets to 8
    assert decoder.prompt_cache.take(compiled, other[0], (), 128)[1] == 0


def test_static_kv_stacks_only_tensors_back_to_back():
    """StaticKV.stacked views every tensor at once only where they lie back to back in one storage (an arena):
    writing through it writes them; tensors of their own storages keep the per-tensor commit."""
    from draftsmith.models.compiled import StaticKV
    from draftsmith.models.kernels import arena_zeros

    like = [torch.zeros(1, 2, 8, 4) for _ in range(3)]
    cache = StaticKV(arena_zeros(like))
    cache.stacked[1, 0, 5] = 7.0
    assert cache.stacked.shape == (3, 2, 8, 4) and float(cache.tensors[1][0, 0, 5].sum()) == 28.0
    assert StaticKV([torch.zeros(1, 2, 8, 4) for _ in range(3)]).stacked is None
    assert StaticKV(arena_zeros([torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 3)])).stacked is None


def test_rotary_tables_are_the_models_own_rotary_and_the_hook_leaves_with_the_forward():
    """A compiled step reads cos and sin from tables of every cache position (inductor would compute them inside every
    layer's rotary kernel): the rows are the model's own rotary embedding's, bit for bit, in the forward's dtype, and
    the stock module answers for itself again once the step's forward is over."""
    from draftsmith.models.compiled import RotaryTables

    decoder = tiny_model("llama", seed=3, num_layers=2).get_decoder()
    rotary = decoder.rotary_emb
    tables = RotaryTables.of(decoder, 40)
    positions = torch.tensor([[0, 7, 7, 31, 39]])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, 5, 8, dtype=dtype)
        own = rotary(x, positions)
        with tables.replacing(rotary):
            hooked = rotary(x, position_ids=positions)
        for got, want in zip(hooked, own):
            assert got.dtype == dtype and torch.equal(got, want)
    with tables.replacing(rotary):
        pass
    assert not rotary._forward_hooks  # removed
    rotary.rope_type = "dynamic"  # cos and sin that depend on the sequence's length: no tables
    assert RotaryTables.of(decoder, 40) is None


def test_a_steps_package_key_covers_the_rotary_tables_code(monkeypatch):
    """The tables' code is traced into the packages, so it is part of their key (an edit of it builds new ones)."""
    from draftsmith.models import compiled
    from draftsmith.models.engine import with_cache

    model = tiny_model("llama", seed=3, num_layers=1)
    cache, _ = compiled.static_cache(model.config, 16, lambda c: model(input_ids=torch.zeros(1, 1, dtype=torch.long),
                                                                        **with_cache(c), use_cache=True))
    with_tables = compiled.traced_code_digest(compiled.StepModule(model, cache))
    monkeypatch.setattr(compiled.RotaryTables, "of", staticmethod(lambda model, capacity: None))
    assert compiled.traced_code_digest(compiled.StepModule(model, cache)) != with_tables
