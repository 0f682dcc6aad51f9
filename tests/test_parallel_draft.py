"""Parallel (PARD) drafting: the training layout shows each mask exactly what it sees at decode time."""

import pytest
import torch

from conftest import tiny_model
from draftsmith.models.engine import additive_mask
from draftsmith.train.parallel_draft import parallel_attention, parallel_inputs, parallel_positions


def test_the_attention_layout_of_three_copies():
    allowed = parallel_attention(length=4, copies=3)
    # copy 2, position 3: the sequence up to position 1, then the masks of copy 1 at 2 and copy 2 at 3 (itself)
    query = 2 * 4 + 3
    assert allowed[query].nonzero().flatten().tolist() == [0, 1, 4 + 2, 8 + 3]
    assert allowed[:4, :4].equal(torch.ones(4, 4, dtype=torch.bool).tril())  # copy 0 is causal
    assert not allowed[:4, 4:].any()  # the sequence never sees a mask


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_mask_sees_what_it_sees_when_decoding(family):
    """Logits of copy j at position p in one PARD forward == the model on x_0..x_{p-j} followed by j masks."""
    model = tiny_model(family, seed=3, num_layers=2).eval()
    mask_token, length, copies = 7, 6, 3
    ids = torch.randint(10, 90, (2, length), generator=torch.Generator().manual_seed(0))
    attention = torch.ones(2, length, dtype=torch.long)
    attention[1, 4:] = 0  # a right-padded second row
    layout = parallel_inputs(ids, attention, copies, mask_token)
    with torch.no_grad():
        logits = model(input_ids=layout.input_ids, position_ids=layout.position_ids,
                       attention_mask=additive_mask(layout.allowed, model.dtype)).logits
        for row, real in ((0, length), (1, 4)):
            for copy in range(copies):
                for position in range(copy, real):
                    prefix = ids[row, :position - copy + 1].tolist() + [mask_token] * copy
                    expected = model(input_ids=torch.tensor([prefix])).logits[0, -1]
                    torch.testing.assert_close(logits[row, copy * length + position], expected, atol=1e-4, rtol=1e-4)


def test_trained_pairs_of_every_copy_need_a_context():
    rows, cols = torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 2, 1])
    out_rows, out_cols, source, copy = parallel_positions(rows, cols, length=5, copies=3)
    assert out_cols.tolist() == [0, 1, 2, 1, 5 + 1, 5 + 2, 5 + 1, 10 + 2]
    assert out_rows.tolist() == [0, 0, 0, 1, 0, 0, 1, 0] and source.tolist() == [0, 1, 2, 3, 1, 2, 3, 2]
    assert copy.tolist() == [0, 0, 0, 0, 1, 1, 1, 2]  # held-out agreement per copy
