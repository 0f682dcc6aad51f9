"""Verification as pure functions: greedy walk, and sampling that preserves the target distribution."""

import pytest
import torch

from draftsmith.eval.decode.drafters.base import Sampling, draw_children
from draftsmith.eval.decode.tree import DraftTree
from draftsmith.eval.decode.verify import logits_to_probs, verify_greedy, verify_sampling

PARENTS = torch.tensor([-1, -1, 0, 1, 2])  # root -> a -> c -> e ; root -> b -> d


def _logits_predicting(next_tokens, vocab=8):
    logits = torch.zeros(len(next_tokens), vocab)
    logits[torch.arange(len(next_tokens)), torch.tensor(next_tokens)] = 5.0
    return logits


def test_greedy_takes_longest_matching_path_and_bonus():
    tree = DraftTree.from_parents(torch.tensor([3, 4, 5, 6, 7]), PARENTS)
    # slot 0 (root) predicts 4 -> node b(1); slot 2 (b) predicts 6 -> node d(3); slot 4 (d) predicts 2 = bonus.
    logits = _logits_predicting([4, 0, 6, 0, 2, 0])
    assert verify_greedy(tree, logits) == ([1, 3], 2)
    # Nothing matches: the bonus is the target's own next token.
    assert verify_greedy(tree, _logits_predicting([1, 0, 0, 0, 0, 0])) == ([], 1)
    # Whole path a -> c -> e accepted, bonus from e's slot.
    assert verify_greedy(tree, _logits_predicting([3, 5, 0, 7, 0, 1])) == ([0, 2, 4], 1)


def test_logits_to_probs_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.count_nonzero(logits_to_probs(logits, 1.0, top_k=2)) == 2
    probs = logits_to_probs(logits, 1.0, top_p=0.7)
    assert probs[0] > 0 and probs[1] > 0 and probs[2] == 0 and probs[3] == 0
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def _empirical_first_token(tree_fn, target_probs, trials, seed):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(target_probs.shape[-1])
    for _ in range(trials):
        tree = tree_fn(gen)
        accepted, token = verify_sampling(tree, target_probs, gen)
        first = int(tree.tokens[accepted[0]]) if accepted else token
        counts[first] += 1
    return counts / trials


@pytest.mark.parametrize("num_children", [1, 3])
def test_sampling_first_token_matches_target(num_children):
    """Children drawn without replacement from q; the first emitted token must follow p exactly."""
    vocab = 6
    p = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    q = torch.tensor([0.3, 0.1, 0.3, 0.05, 0.05, 0.2])
    sampling = Sampling(temperature=1.0)

    def tree_fn(gen):
        tokens, rows = draw_children(q, num_children, sampling, gen)
        return DraftTree.from_parents(tokens, torch.full((num_children,), -1), rows)

    target_probs = torch.stack([p] + [torch.full((vocab,), 1 / vocab)] * num_children)
    freq = _empirical_first_token(tree_fn, target_probs, trials=8000, seed=num_children)
    assert (freq - p).abs().max() < 0.02, (freq, p)


def test_sampling_point_mass_candidates_match_target():
    """Deterministic proposals (q = None) are point masses; still lossless."""
    p = torch.tensor([0.5, 0.3, 0.2])
    tree = DraftTree.from_parents(torch.tensor([2, 1]), torch.tensor([-1, -1]))
    target_probs = torch.stack([p, p, p])
    freq = _empirical_first_token(lambda gen: tree, target_probs, trials=8000, seed=7)
    assert (freq - p).abs().max() < 0.02, freq


def test_draw_children_rows_remove_earlier_siblings():
    probs = torch.tensor([0.5, 0.3, 0.2])
    tokens, rows = draw_children(probs, 3, Sampling(), torch.Generator().manual_seed(0))
    assert sorted(tokens.tolist()) == [0, 1, 2]
    assert rows[1, tokens[0]] == 0 and rows[2, tokens[0]] == 0 and rows[2, tokens[1]] == 0
    torch.testing.assert_close(rows.sum(-1), torch.ones(3))
    greedy, none = draw_children(probs, 2, None, None)
    assert greedy.tolist() == [0, 1] and none is None
