"""Would a datastore of the target's own answers draft where prompt lookup cannot (REST-style retrieval)? For each
plain-compiled output of a goal-bench run, at every position where prompt lookup finds no repeated 3-gram in the
output so far, the longest suffix of it (2-8 tokens) that the target's regenerated answers hold, their most frequent
continuation of up to 8 tokens, and how many of those the target's output then repeats; by match length, beside the
mean a DFlash or lookup round of that run accepted. Offline: no timing, any machine. The output so far stands for
the context (the prompt is left out, so lookup finds fewer repeats than in the decoder and the datastore is asked
more often than it would be).
    python scripts/jobs/datastore_probe.py <bench.json> [output.json]   (a markdown table beside it; an existing
    output is refused)
"""
import collections
import json
import sys
from pathlib import Path

import torch
from ab_arguments import probe_output

from draftsmith.data.sources import load_source
from draftsmith.eval.decode.drafters.ngram import NgramDrafter
from draftsmith.eval.documents import write_document
from draftsmith.models.target import load_tokenizer

POOL = "conversations:datasets/regenerated/smollm2-135m-instruct/pool_bf16"
LONGEST, SHORTEST, CONTINUATION, LOOKUP_N = 8, 2, 8, 3


def answer_tokens() -> list[list[int]]:
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    answers = [conv.messages[-1]["content"] for conv in load_source(POOL)]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in answers]


def build_index(sequences: list[list[int]]) -> dict[int, dict]:
    """For each suffix length n: n tokens -> the counts of the (up to CONTINUATION) tokens that followed them."""
    index = {}
    for n in range(SHORTEST, LONGEST + 1):
        table = collections.defaultdict(collections.Counter)
        for tokens in sequences:
            for end in range(n, len(tokens)):
                table[tuple(tokens[end - n:end])][tuple(tokens[end:end + CONTINUATION])] += 1
        index[n] = table
    return index


def matched(index: dict, output: list[int], end: int) -> tuple[int, int]:
    """(the longest suffix length the datastore holds, 0 if none; the tokens of its continuation the output repeats)."""
    for n in range(LONGEST, SHORTEST - 1, -1):
        found = index[n].get(tuple(output[end - n:end])) if end >= n else None
        if found:
            continuation = found.most_common(1)[0][0]
            accepted = 0
            while accepted < len(continuation) and end + accepted < len(output) \
                    and continuation[accepted] == output[end + accepted]:
                accepted += 1
            return n, accepted
    return 0, 0


def round_means(bench: dict) -> dict[str, float]:
    """Each cascade sub-drafter's accepted tokens a round in the run (its policies' record)."""
    means = {}
    for label, policy in bench.get("policies", {}).items():
        for drafter, rounds in policy.get("rounds_proposed", {}).items():
            if rounds:
                means[f"{label}: {drafter.split(':')[0]}"] = policy["accepted_tokens"][drafter] / rounds
    return means


def main(argv: list[str]) -> None:
    if not 2 <= len(argv) <= 3 or not Path(argv[1]).is_file():
        sys.exit("usage: python scripts/jobs/datastore_probe.py <bench.json> [output.json]")
    bench = json.loads(Path(argv[1]).read_text())
    output_path = probe_output(argv[1:])
    index = build_index(answer_tokens())
    by_length = collections.defaultdict(lambda: [0, 0, 0])  # positions, accepted tokens, first token accepted
    lookup = NgramDrafter(LOOKUP_N, LOOKUP_N)  # the cascade's lookup: it proposes where it finds a continuation
    for row in bench["per_prompt"]:
        output = row["plain-compiled"]["tokens"]
        for end in range(1, len(output)):
            if not lookup.continuations(torch.tensor(output[:end])):
                n, accepted = matched(index, output, end)
                cell = by_length[n]
                cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + accepted, cell[2] + (accepted > 0)
    rows = {n: {"positions": c[0], "mean_accepted": c[1] / c[0], "first_accepted": c[2] / c[0]}
            for n, c in sorted(by_length.items())}
    means = round_means(bench)
    lines = [f"{argv[1]}: {len(bench['per_prompt'])} plain-compiled outputs; the positions where lookup on "
             f"{LOOKUP_N}-grams has no repeat, by the longest suffix the regenerated answers hold", "",
             "| suffix matched | positions | continuation tokens repeated, mean | its first token repeated |",
             "|---|---|---|---|"]
    lines += [f"| {n or 'none'} | {r['positions']} | {r['mean_accepted']:.2f} | {r['first_accepted']:.2f} |"
              for n, r in rows.items()]
    lines += ["", "Accepted a round in the same run: " + "; ".join(f"{k} {v:.2f}" for k, v in means.items())]
    write_document(output_path, {"bench": argv[1], "by_suffix_length": rows, "round_means": means},
                   "\n".join(lines))


if __name__ == "__main__":
    main(sys.argv)
