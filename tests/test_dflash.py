"""The DFlash block drafter: the decoder's forward is the trained one (eager, and as compiled graphs over a static
cache), decoding with it is lossless, and the recipe trains, saves and loads it."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from conftest import build_spec, tiny_model
from draftsmith.config import ConfigError, load_config
from draftsmith.errors import UserError
from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.base import InputError, TreeCut, confident_subtree, static_tree_tokens
from draftsmith.eval.decode.drafters.dflash import DFlashDrafter, load_dflash_drafter
from draftsmith.eval.decode.tree import DraftTree, path_to_root
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.compiled_dflash import CompiledDFlashEngine
from draftsmith.models.artifacts import load_dflash, save_dflash, store_in_bfloat16, target_block
from draftsmith.models.kernels import Kernels, WeightPrecision
from draftsmith.models.dflash import DFlashConfig, DFlashModel, anchored_block_mask, evenly_spaced_layers
from draftsmith.models.target import TargetModel
from draftsmith.models.tiny import TinyTokenizer
from draftsmith.models.vocab import DraftVocab
from draftsmith.train.dflash import (DFlashRecipeConfig, anchor_count, block_targets, draw_anchors, drafter_config,
                                     main, start_from)


def random_drafter(model, layers=(0, 2), block=4, seed=3) -> DFlashModel:
    torch.manual_seed(seed)
    config = DFlashConfig.from_target(model.config, num_layers=2, block_size=block, target_layer_ids=list(layers),
                                      mask_token_id=model.config.vocab_size - 1)
    return DFlashModel(config).attach_target(model).eval()


def token_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's tokens from the root's child down to it, in node order."""
    tokens = tree.tokens.tolist()
    return [tuple(tokens[at] for at in path_to_root(tree.parents, node)) for node in range(tree.size)]


def target_features(model, ids, drafter: DFlashModel) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden[i] for i in drafter.config.hidden_layers], -1)


def test_decoder_block_equals_the_trained_block():
    """The block the decoder runs over its cached context (observe, then one forward) gives the logits the
    training forward gives the same anchor (the anchored-block mask, the context before the anchor)."""
    model = tiny_model("llama", seed=1, num_layers=4)
    dflash = random_drafter(model)
    ids = torch.randint(0, 90, (1, 20), generator=torch.Generator().manual_seed(0))
    features = target_features(model, ids, dflash)
    anchors, valid = torch.tensor([[5, 11, 16]]), torch.tensor([[True, True, True]])
    with torch.no_grad():
        trained = dflash.lm_head(dflash(features, ids, torch.ones_like(ids), anchors, valid))  # (1, A, block, V)
    for j, anchor in enumerate(anchors[0].tolist()):
        drafter = DFlashDrafter(dflash)
        drafter.begin(ids[0, :anchor])
        drafter.observe(ids[0, :anchor], {layer: h[0, :anchor] for layer, h in
                                         zip(dflash.config.hidden_layers, features.split(48, -1))})
        decoded = drafter.block_logits(int(ids[0, anchor]))
        assert (decoded - trained[0, j, 1:]).abs().max().item() < 1e-5


def test_the_kernels_attention_gives_the_stock_attentions_block_logits():
    """On the batch-invariant kernels every draft layer attends through draftsmith::attention (only the keys the
    mask shows are read); the block's logits are the stock attention's, as the context grows."""
    model = tiny_model("llama", seed=1, num_layers=4)
    dflash = random_drafter(model)
    stock, kernels = DFlashDrafter(dflash), DFlashDrafter(dflash, precision=WeightPrecision.MODEL)
    assert all(layer.self_attn.kernel_attention for layer in kernels.engine.model.layers)
    assert not any(layer.self_attn.kernel_attention for layer in dflash.layers)  # the model itself unchanged
    features = torch.randn(1, 30, 2 * model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    for drafter in (stock, kernels):
        drafter.begin(None)
    start = 0
    for size in [9, 1, 4, 16]:
        split = dict(zip(dflash.config.hidden_layers, features[0, start:start + size].split(48, -1)))
        logits = []
        for drafter in (stock, kernels):
            drafter.observe(None, split)
            logits.append(drafter.block_logits(5))
        start += size
        assert (logits[0] - logits[1]).abs().max().item() < 1e-4


def test_the_context_buffers_grow_and_give_the_concatenated_blocks_logits():
    """Observed a few positions at a time past the buffers' first capacity (256 slots; each round's block written
    after the context and then overwritten), the drafter's block logits are those of the whole context's keys
    and values concatenated (the training layout)."""
    model = tiny_model("llama", seed=2, num_layers=4)
    dflash = random_drafter(model, block=5)
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(1, 300, 2 * model.config.hidden_size, generator=generator)
    drafter = DFlashDrafter(dflash)
    drafter.begin(None)
    start = 0
    for size in [40, 1, 3, 200, 2, 1, 53]:  # 300 positions; a block runs after each
        split = features[0, start:start + size].split(model.config.hidden_size, -1)
        drafter.observe(None, dict(zip(dflash.config.hidden_layers, split)))
        start += size
        buffered = drafter.block_logits(7)
        with torch.no_grad():
            context = dflash.context_kv(features[:, :start], torch.arange(start)[None])
            ids = torch.full((1, 5), dflash.config.mask_token_id)
            ids[0, 0] = 7
            hidden = dflash.block_hidden(ids, torch.arange(start, start + 5)[None], context, None)[0, 1:]
        assert (buffered - dflash.lm_head(hidden)).abs().max().item() < 1e-5
    assert drafter.engine.buffers.capacity >= 300 + 5


def test_anchored_mask_sees_the_context_before_its_anchor_and_its_own_block():
    mask = anchored_block_mask(torch.tensor([[2, 4]]), torch.tensor([[True, False]]), torch.ones(1, 6), 2)[0, 0]
    assert mask.shape == (4, 6 + 4)
    assert mask[0, :6].tolist() == [True, True, False, False, False, False]
    assert not mask[2, :6].any()  # a padded anchor sees no context
    assert mask[0, 6:].tolist() == [True, True, False, False] and mask[3, 6:].tolist() == [False, False, True, True]


def test_anchors_are_answer_positions_with_an_answer_token_after_them():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 0, 0, 0, 0, 0, 0]])
    anchors, valid = draw_anchors(loss_mask, 8, torch.Generator().manual_seed(0))
    assert anchors[0][valid[0]].tolist() == [2, 3, 6] and not valid[1].any()
    assert anchor_count(loss_mask, 8) == 3 and anchor_count(loss_mask, 2) == 2
    ahead, labelled = block_targets(loss_mask, anchors, valid, 3)
    assert ahead[0, 0].tolist() == [3, 4] and labelled[0, 0].tolist() == [True, True]
    assert labelled[0, 1].tolist() == [True, False]  # position 5 is not an answer token
    assert labelled[0, 2].tolist() == [True, False]  # position 8 is past the record


@pytest.mark.parametrize("vocab", [False, True])
def test_greedy_decoding_with_dflash_equals_plain(vocab):
    model = tiny_model("llama", seed=2, num_layers=4)
    target = TargetModel(model, tokenizer=None)
    draft_vocab = DraftVocab.from_ids(list(range(0, 96, 2)), 96) if vocab else None
    drafter = DFlashDrafter(random_drafter(model), vocab=draft_vocab, stop_below=0.01 if vocab else None)
    prompt = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(4))
    plain = SpeculativeDecoder(target, None, DecodeConfig(max_new_tokens=24)).generate(prompt)
    result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=24)).generate(prompt)
    assert result.tokens == plain.tokens
    assert result.stats.verify_forwards < 24 or vocab  # a random drafter on a random target still lands some


@pytest.mark.parametrize("precision", [None, WeightPrecision.MODEL, WeightPrecision.INT8])
def test_a_bfloat16_dflash_drafter_decodes_like_the_float32_target(precision):
    """A bf16 drafter (dtype=bfloat16: the target's features and head rows cast to it), eager or on the
    batch-invariant kernels (its weights bf16 or int8), proposes what its arithmetic gives; the fp32 target's verify
    keeps the output plain's."""
    model = tiny_model("llama", seed=2, num_layers=4)
    target = TargetModel(model, tokenizer=None)
    draft_vocab = DraftVocab.from_ids(list(range(0, 96, 2)), 96)
    drafter = DFlashDrafter(random_drafter(model).to(torch.bfloat16), vocab=draft_vocab, precision=precision)
    head = drafter.engine.head.weight if precision is None else drafter.engine.head.packed
    assert head.dtype == (torch.int8 if precision is WeightPrecision.INT8 else torch.bfloat16)
    prompt = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(4))
    plain = SpeculativeDecoder(target, None, DecodeConfig(max_new_tokens=24)).generate(prompt)
    result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=24)).generate(prompt)
    assert result.tokens == plain.tokens


@pytest.mark.parametrize("stop_below", [None, 0.05])
def test_a_dflash_tree_decodes_like_plain(stop_below):
    """topk > 1: the top candidates of every block position under the previous position's first, one forward."""
    model = tiny_model("llama", seed=2, num_layers=4)
    target = TargetModel(model, tokenizer=None)
    drafter = DFlashDrafter(random_drafter(model), topk=3, stop_below=stop_below)
    assert drafter.parents.tolist() == [-1, -1, -1, 0, 0, 0, 3, 3, 3]  # block 4: 3 positions x 3 candidates
    prompt = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(4))
    plain = SpeculativeDecoder(target, None, DecodeConfig(max_new_tokens=24)).generate(prompt)
    result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=24)).generate(prompt)
    assert result.tokens == plain.tokens


def test_keep_above_trims_a_dflash_tree_and_stays_lossless():
    """keep_above (greedy): fewer tokens verified a round than the whole tree, never none, output unchanged; a
    sampled decode refuses it in one line."""
    model = tiny_model("llama", seed=2, num_layers=4)
    target = TargetModel(model, tokenizer=None)
    prompt = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(4))
    plain = SpeculativeDecoder(target, None, DecodeConfig(max_new_tokens=24)).generate(prompt)
    drafter = DFlashDrafter(random_drafter(model), topk=3, keep_above=0.02)
    result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=24)).generate(prompt)
    assert result.tokens == plain.tokens
    assert 1 <= result.stats.tree_tokens / result.stats.verify_forwards < 9
    with pytest.raises(UserError, match="keep_above"):
        SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=4, temperature=0.8)).generate(prompt)


@pytest.mark.parametrize("topk, nodes", [(1, None), (3, None), (3, 6)])
def test_round_costs_cut_a_dflash_round_and_stay_lossless(topk, nodes):
    """round_costs (greedy): a verify that costs much more from three tokens on keeps rounds of one node, a flat
    cost the whole tree; output unchanged either way; a sampled decode refuses them in one line."""
    model = tiny_model("llama", seed=2, num_layers=4)
    target = TargetModel(model, tokenizer=None)
    prompt = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(4))
    plain = SpeculativeDecoder(target, None, DecodeConfig(max_new_tokens=24)).generate(prompt)
    per_round = {}
    for costs in ([1.0] + [9.0] * 8, [1.0] * 9):
        drafter = DFlashDrafter(random_drafter(model), topk=topk, nodes=nodes, round_costs=costs)
        result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=24)).generate(prompt)
        assert result.tokens == plain.tokens
        per_round[costs[1]] = result.stats.tree_tokens / result.stats.verify_forwards
    whole = 3 if topk == 1 else 9 if nodes is None else nodes
    assert per_round[9.0] == 1 and per_round[1.0] == whole
    with pytest.raises(UserError, match="round_costs"):
        SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=4, temperature=0.8)).generate(prompt)
    with pytest.raises(InputError, match="round_costs"):
        DFlashDrafter(random_drafter(model), round_costs=[1.0, 0.0])


@pytest.mark.parametrize("stop_below, keep_above", [(None, None), (None, 0.02), (0.05, 0.01), (None, 0.3)])
def test_the_greedy_tree_is_the_static_trees_top_candidates(stop_below, keep_above):
    """The greedy tree from one top-k over the block equals the static tree's construction (each node's token drawn
    by rank from its position's distribution, path probabilities through the ancestor matrix) for random blocks."""
    model = tiny_model("llama", seed=2, num_layers=4)
    drafter = DFlashDrafter(random_drafter(model, block=5), topk=3, stop_below=stop_below, keep_above=keep_above)
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        probs = torch.softmax(3 * torch.randn(4, 96, generator=generator), -1)
        depth = drafter._kept(probs.max(-1).values)
        nodes = depth * 3
        tokens, _ = static_tree_tokens(lambda d: probs[d - 1], drafter.depths[:nodes], drafter.ranks[:nodes], None,
                                       None)
        whole = DraftTree(tokens, drafter.parents[:nodes], drafter.depths[:nodes])
        expected = confident_subtree(whole, probs[drafter.depths[:nodes] - 1, tokens], TreeCut(keep_above))
        tree = drafter._greedy_tree(probs, torch.device("cpu"))
        for field in ("tokens", "parents", "depths"):
            assert torch.equal(getattr(tree, field), getattr(expected, field))


@pytest.mark.parametrize("nodes, keep_above, stop_below", [(6, None, None), (10, 0.02, None), (4, None, 0.05)])
def test_a_dflash_product_tree_decodes_like_plain(nodes, keep_above, stop_below):
    """nodes: every path of top-k candidates cut to its best; lossless, at most `nodes` verified a round; a sampled
    decode and a chain (topk 1) refuse it in one line."""
    model = tiny_model("llama", seed=2, num_layers=4)
    target = TargetModel(model, tokenizer=None)
    prompt = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(4))
    plain = SpeculativeDecoder(target, None, DecodeConfig(max_new_tokens=24)).generate(prompt)
    drafter = DFlashDrafter(random_drafter(model), topk=3, nodes=nodes, keep_above=keep_above, stop_below=stop_below)
    assert drafter.parents.numel() == 3 + 9 + 27
    result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=24)).generate(prompt)
    assert result.tokens == plain.tokens
    assert 1 <= result.stats.tree_tokens / result.stats.verify_forwards <= nodes
    with pytest.raises(UserError, match="(nodes|keep_above).*greedy"):
        SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=4, temperature=0.8)).generate(prompt)
    with pytest.raises(UserError, match="topk > 1"):
        DFlashDrafter(random_drafter(model), nodes=4)


@pytest.mark.parametrize("nodes, keep_above", [(5, None), (8, 0.02), (40, None)])
def test_the_product_tree_keeps_the_most_probable_paths(nodes, keep_above):
    """The kept nodes are the `nodes` token paths of largest product of block-position probabilities (every path
    of top-3 candidates, enumerated), those above keep_above when given, for random blocks."""
    model = tiny_model("llama", seed=2, num_layers=4)
    drafter = DFlashDrafter(random_drafter(model, block=4), topk=3, nodes=nodes, keep_above=keep_above)
    generator = torch.Generator().manual_seed(5)
    for _ in range(20):
        probs = torch.softmax(3 * torch.randn(3, 96, generator=generator), -1)
        values, indices = probs.topk(3, -1)
        scored = {}
        for ranks in itertools.chain.from_iterable(itertools.product(range(3), repeat=d) for d in (1, 2, 3)):
            path = tuple(int(indices[d, r]) for d, r in enumerate(ranks))
            scored[path] = math.prod(float(values[d, r]) for d, r in enumerate(ranks))
        best = sorted(scored, key=lambda path: (-scored[path], len(path)))
        if keep_above is not None:
            best = best[:max(1, sum(p > keep_above for p in scored.values()))]
        tree = drafter._greedy_tree(probs, torch.device("cpu"))
        assert set(token_paths(tree)) == set(best[:nodes])


@pytest.fixture(scope="module")
def compiled_dflash():
    """(tiny target, its random DFlash model, that drafter on the compiled backend with its graphs built)."""
    model = tiny_model("llama", seed=2, num_layers=4)
    dflash = random_drafter(model, block=4)
    drafter = DFlashDrafter(dflash, budget=3, precision=WeightPrecision.MODEL, topk=3,
                            compiled=CompileSettings(buckets=[1, 8], capacity=128, autotune=False))
    for graphs in drafter.engine.graphs:
        graphs.prepare()
    return model, dflash, drafter


def test_the_compiled_block_gives_the_eager_blocks_logits(compiled_dflash):
    """Context observed in pieces (one longer than the largest bucket: chunked), a block after each: the compiled
    graphs' logits are the eager drafter's on the same kernels."""
    model, dflash, compiled = compiled_dflash
    eager = DFlashDrafter(dflash, budget=3, precision=WeightPrecision.MODEL, topk=3)
    features = torch.randn(1, 40, 2 * model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for drafter in (eager, compiled):
        drafter.begin(None)
    start = 0
    for size in [13, 1, 3, 8, 2]:
        split = dict(zip(dflash.config.hidden_layers, features[0, start:start + size].split(48, -1)))
        logits = []
        for drafter in (eager, compiled):
            drafter.observe(None, split)
            logits.append(drafter.block_logits(7))
        start += size
        assert compiled.length == start and (logits[0] - logits[1]).abs().max().item() < 1e-4


def test_the_compiled_dflash_drafter_decodes_like_plain_and_refuses_a_full_cache(compiled_dflash):
    model, dflash, drafter = compiled_dflash
    target = TargetModel(model, tokenizer=None)
    prompt = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(4))
    plain = SpeculativeDecoder(target, None, DecodeConfig(max_new_tokens=24)).generate(prompt)
    assert SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=24)).generate(prompt).tokens == plain.tokens
    small = CompiledDFlashEngine(drafter.engine.context.runs, drafter.engine.block.step.head, 4,
                                 CompileSettings(buckets=[1, 8], capacity=16, autotune=False))
    small.begin()
    with pytest.raises(UserError, match="cannot hold 14 context positions and a block of 4"):
        small.append(torch.zeros(1, 14, 2 * model.config.hidden_size))


@pytest.mark.slow  # two more builds (~45 s); the invariant kernels' graphs are the default, tested above
def test_the_compiled_dflash_drafter_on_inductors_kernels_decodes_like_plain():
    """compile.kernels=inductor: the drafter's own Linears (not the batch-invariant ones) frozen into its graphs."""
    model = tiny_model("llama", seed=2, num_layers=4)
    settings = CompileSettings(buckets=[1, 8], capacity=128, autotune=False, kernels=Kernels.INDUCTOR)
    drafter = DFlashDrafter(random_drafter(model, block=4), budget=3, compiled=settings)
    target = TargetModel(model, tokenizer=None)
    prompt = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(4))
    plain = SpeculativeDecoder(target, None, DecodeConfig(max_new_tokens=24)).generate(prompt)
    assert SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=24)).generate(prompt).tokens == plain.tokens


def test_budget_beyond_the_block_is_refused():
    model = tiny_model("llama", seed=2, num_layers=4)
    with pytest.raises(InputError, match="budget=4 is more than the block of 4"):
        DFlashDrafter(random_drafter(model), budget=4)


def test_layers_spaced_like_dflash_and_never_the_last():
    assert evenly_spaced_layers(30, 5) == [1, 7, 14, 21, 27]
    assert evenly_spaced_layers(2, 2) == [0]


def test_recipe_trains_saves_and_decodes_losslessly(tmp_path):
    cfg = load_config(DFlashRecipeConfig, "train/configs/dflash_tiny.yaml", [f"output_dir={tmp_path}/run"])
    summary = main(cfg)
    assert summary["eval_after"]["eval/top1_pos1"] >= 0
    target = TargetModel.from_pretrained("tiny:llama")
    drafter = load_dflash_drafter(tmp_path / "run" / "final", target)
    spec = build_spec(f"dflash:{tmp_path}/run/final,budget=2,stop_below=0.5", target)  # the bench's method
    assert isinstance(spec, DFlashDrafter) and spec.budget == 2 and spec.stop_below == 0.5
    prompt = torch.tensor([[3, 5, 7, 9, 11]])
    plain = SpeculativeDecoder(target, None, DecodeConfig(max_new_tokens=16)).generate(prompt)
    assert SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=16)).generate(prompt).tokens == plain.tokens


def test_recipe_refuses_the_last_layer_an_unread_option_and_a_mask_outside_the_embeddings(tmp_path):
    for overrides, message in [(["drafter.target_layer_ids=[1]", "drafter.num_target_layers=5"], "the last one's output"),
                               (["drafter.target_layer_ids=[0]"], "num_target_layers=2 is not read here"),
                               (["drafter.mask_token_id=null"], "uses every row")]:
        with pytest.raises(ConfigError, match=message):
            main(load_config(DFlashRecipeConfig, "train/configs/dflash_tiny.yaml",
                             [f"output_dir={tmp_path}/run", *overrides]))


def test_a_snapshot_stored_in_bfloat16_loads_into_the_float32_drafter(tmp_path):
    model = tiny_model("llama", seed=2, num_layers=4)
    target = TargetModel(model, tokenizer=TinyTokenizer(96))
    dflash = random_drafter(model)
    save_dflash(dflash, tmp_path, target_block(target, "tiny:llama", dflash.config.hidden_layers))
    assert store_in_bfloat16(tmp_path) == ["dflash.safetensors"]
    loaded, manifest = load_dflash(tmp_path, target)
    assert manifest["drafter"]["dtype"] == "bfloat16" and loaded.fc.weight.dtype == torch.float32
    assert torch.equal(loaded.fc.weight, dflash.fc.weight.to(torch.bfloat16).float())


def test_recipe_starts_from_a_finished_drafter(tmp_path):
    """drafter.init_from: a run starts from a finished drafter's weights (e.g. continued on other data); another
    layout is refused in one line naming what differs."""
    tiny = "train/configs/dflash_tiny.yaml"
    main(load_config(DFlashRecipeConfig, tiny, [f"output_dir={tmp_path}/first", "train.max_steps=2"]))
    first = tmp_path / "first" / "final"
    second = load_config(DFlashRecipeConfig, tiny, [f"output_dir={tmp_path}/second", f"drafter.init_from={first}"])
    target = TargetModel.from_pretrained(second.target)
    drafter = DFlashModel(drafter_config(second.drafter, target)).attach_target(target.model)
    start_from(drafter, str(first), target)
    finished, _ = load_dflash(first, target)
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), finished.state_dict().values()))
    main(second)
    with pytest.raises(ConfigError, match=r"drafter.init_from=.*its drafter differs from this config's: .*block_size"):
        main(load_config(DFlashRecipeConfig, tiny, [f"output_dir={tmp_path}/bad", f"drafter.init_from={first}",
                                                    "drafter.block_size=3"]))
