"""Tree structure, masks and position ids; tree-masked forward == sequential forward; KV commit."""

import pytest
import torch

from conftest import tiny_model
from draftsmith.eval.decode.tree import (DraftTree, ancestor_matrix, chain_paths, node_depths, path_to_root, select_top_nodes,
                       subtree, tree_attention_mask, tree_from_paths, tree_position_ids)
from draftsmith.eval.decode.drafters.base import TreeCut, confident_subtree, costs_cut
from draftsmith.models.engine import commit_kv
from draftsmith.models.target import TargetModel

# root -> a(0) -> c(2) -> e(4); root -> b(1) -> d(3)
PARENTS = torch.tensor([-1, -1, 0, 1, 2])


def test_depths_and_paths():
    assert node_depths(PARENTS).tolist() == [1, 1, 2, 2, 3]
    assert path_to_root(PARENTS, 4) == [0, 2, 4]
    assert path_to_root(PARENTS, -1) == []


def test_ancestor_matrix_and_mask():
    reach = ancestor_matrix(PARENTS)  # slots: 0 root, node i at i + 1
    assert reach[5].tolist() == [True, True, False, True, False, True]  # e sees root, a, c, itself
    assert reach[4].tolist() == [True, False, True, False, True, False]  # d sees root, b, itself
    mask = tree_attention_mask(PARENTS, past_len=3)
    assert mask.shape == (1, 1, 6, 9)
    assert mask[0, 0, :, :3].all()  # every slot sees the whole committed prefix
    assert torch.equal(mask[0, 0, :, 3:], reach)


def test_position_ids():
    assert tree_position_ids(node_depths(PARENTS), past_len=7).tolist() == [[7, 8, 8, 9, 9, 10]]


def test_tree_from_paths_sorted_and_validated():
    parents, depths, ranks = tree_from_paths([[0, 1], [1], [0], [0, 0]])
    assert parents.tolist() == [-1, -1, 0, 0]
    assert depths.tolist() == [1, 1, 2, 2]
    assert ranks.tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="no parent path"):
        tree_from_paths([[0], [1, 0]])
    assert tree_from_paths(chain_paths(3))[0].tolist() == [-1, 0, 1]


def test_select_top_nodes_is_ancestor_closed():
    scores = torch.tensor([-0.1, -2.0, -0.5, -2.1, -0.6])
    keep = select_top_nodes(scores, PARENTS, budget=3)
    assert keep.tolist() == [0, 2, 4]
    # A deep node whose chain does not fit is skipped in favour of one that does.
    keep = select_top_nodes(torch.tensor([-0.1, -0.2, -0.3, -0.25, -0.05]), PARENTS, budget=2)
    assert set(keep.tolist()) == {0, 1}
    tree = DraftTree.from_parents(torch.tensor([10, 11, 12, 13, 14]), PARENTS)
    small = subtree(tree, torch.tensor([1, 3]))
    assert small.tokens.tolist() == [11, 13] and small.parents.tolist() == [-1, 0]


def test_confident_subtree_keeps_the_paths_above_the_threshold():
    """root -> a(0) -> c(2) -> e(4); root -> b(1) -> d(3): path probabilities 0.6, 0.3, 0.3, 0.12, 0.27."""
    tree = DraftTree(torch.arange(10, 15), PARENTS, node_depths(PARENTS))
    probs = torch.tensor([0.6, 0.3, 0.5, 0.4, 0.9])
    kept = confident_subtree(tree, probs, TreeCut(0.25))
    assert kept.tokens.tolist() == [10, 11, 12, 14] and kept.parents.tolist() == [-1, -1, 0, 2]
    assert confident_subtree(tree, probs, TreeCut(0.9)).tokens.tolist() == [10]  # never empty: the best path first
    assert confident_subtree(tree, probs, TreeCut()) is tree


def test_costs_cut_keeps_the_node_count_with_the_most_tokens_per_cost():
    """A round of n nodes commits 1 + their path probabilities' sum and costs round_costs[n - 1]."""
    import math

    scores = [math.log(p) for p in (0.8, 0.3, 0.2, 0.1)]
    assert costs_cut(scores, [1.0, 1.0, 1.0, 1.0]) == 4  # width free: every node
    assert costs_cut(scores, [1.0, 1.1, 1.2, 1.3]) == 3  # 2.3 / 1.2 beats 2.1 / 1.1 and 2.4 / 1.3
    assert costs_cut(scores, [1.0, 1.3, 1.35, 1.4]) == 1  # a step at three tokens: 1.8 / 1.0 beats 2.1 / 1.3
    assert costs_cut(scores, [1.0, 1.1]) == 2  # none beyond the costs given
    assert costs_cut([math.log(0.01)], [5.0]) == 1  # at least one node
    tree = DraftTree(torch.arange(10, 15), PARENTS, node_depths(PARENTS))
    probs = torch.tensor([0.6, 0.3, 0.5, 0.4, 0.9])  # path probabilities 0.6, 0.3, 0.3, 0.12, 0.27
    kept = confident_subtree(tree, probs, TreeCut(None, (1.0, 1.5, 1.6, 1.7, 1.8)))
    assert kept.tokens.tolist() == [10]  # 1.6 / 1.0 against 1.9 / 1.5, 2.2 / 1.6, 2.47 / 1.7, 2.59 / 1.8
    kept = confident_subtree(tree, probs, TreeCut(None, (1.0, 1.1, 1.2, 1.3, 1.4)))
    assert kept.tokens.tolist() == [10, 11, 12, 14]  # 2.47 / 1.3 the best rate: the 0.12 path left out


def test_validate_rejects_unordered_trees():
    with pytest.raises(ValueError, match="topologically"):
        DraftTree(tokens=torch.tensor([1, 2]), parents=torch.tensor([1, -1]), depths=torch.tensor([2, 1])).validate()


def _random_tree(generator, n):
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(1, n)]
    return torch.tensor(parents)


@pytest.mark.parametrize("seed", range(4))
def test_tree_forward_equals_sequential(family, seed):
    """Logits of every tree slot == logits of a plain forward over that node's root path."""
    model = tiny_model(family, seed=seed)
    target = TargetModel(model, tokenizer=None)
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 96, (1, 9), generator=gen)
    parents = _random_tree(gen, 7)
    tokens = torch.randint(0, 96, (7,), generator=gen)
    cache = target.new_cache()
    target.forward(prefix[:, :-1], cache)
    past = cache.get_seq_length()
    tree_in = torch.cat([prefix[0, -1:], tokens])[None]
    out = target.forward(tree_in, cache, tree_position_ids(node_depths(parents), past),
                         tree_attention_mask(parents, past), hidden_layers=(-2,))
    for node in range(7):
        path = tokens[path_to_root(parents, node)]
        full = model(torch.cat([prefix[0], path])[None], output_hidden_states=True)
        torch.testing.assert_close(out.logits[0, node + 1], full.logits[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.hidden[-2][0, node + 1], full.hidden_states[-2][0, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_kv_commit_equals_sequential(family, seed):
    """After committing an accepted path, the cache equals the cache of feeding that path in order."""
    model = tiny_model(family, seed=seed)
    target = TargetModel(model, tokenizer=None)
    gen = torch.Generator().manual_seed(100 + seed)
    prefix = torch.randint(0, 96, (1, 6), generator=gen)
    parents = _random_tree(gen, 8)
    tokens = torch.randint(0, 96, (8,), generator=gen)
    node = int(torch.randint(0, 8, (1,), generator=gen))
    path = path_to_root(parents, node)

    cache = target.new_cache()
    target.forward(prefix[:, :-1], cache)
    past = cache.get_seq_length()
    target.forward(torch.cat([prefix[0, -1:], tokens])[None], cache,
                   tree_position_ids(node_depths(parents), past), tree_attention_mask(parents, past))
    commit_kv(cache, torch.cat([torch.arange(past + 1), past + 1 + torch.tensor(path)]))

    reference = target.new_cache()
    target.forward(torch.cat([prefix[0], tokens[path]])[None], reference)
    assert cache.get_seq_length() == reference.get_seq_length()
    for ours, theirs in zip(cache.layers, reference.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-5)
    # And the next step sees the same logits.
    nxt = torch.tensor([[5]])
    torch.testing.assert_close(target.forward(nxt, cache).logits, target.forward(nxt, reference).logits,
                               atol=1e-4, rtol=1e-4)
