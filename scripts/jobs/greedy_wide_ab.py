"""In-process A/B of the greedy head's copies on AMX: GREEDY_WIDE's (models.kernels: the int8 quads from one row)
against the int8 rows in pairs widened on the tiles from 7 rows (`int8 pairs from 7`, its copy before the quads).
SmolLM2-135M-Instruct float32 on the compiled engine, plain decoding and the bundled drafter with int8 weights as its
dynamic tree (verifies of up to 9 rows), MT-Bench first turns, 128 new tokens; per prompt both arms in alternating
order, each arm's speedup over its own plain. Same tokens in every arm and method (checked). AMX CPUs only. With
`rows`, the first arm is the int8 pairs from that many rows instead of 7.
    scripts/jobs/quiet.sh python scripts/jobs/greedy_wide_ab.py [float32] [prompts] [output.json] [rows]
"""
import sys

import torch
from ab_arguments import ab_arguments, alternating_rates, int8_tree_decoders, write_result

from draftsmith.models.kernels import KernelIsa, WideCopy, arena_zeros, kernel_isa, quantize_int8, wide_copy


def arm_copies(head, rows: int | None) -> dict[str, tuple]:
    """{arm: (wide copy, from rows, packed copy)}: the int8 pairs from `rows` (7 when None), and GREEDY_WIDE's copy."""
    pairs_from = 7 if rows is None else rows
    pairs = wide_copy(WideCopy.INT8_PAIRS, head.weight, quantize_int8(head.weight)[0])
    pairs = arena_zeros([pairs])[0].copy_(pairs)  # a weight arena of its own, as placed_greedy_head places the others
    return {f"int8 pairs from {pairs_from}": (WideCopy.INT8_PAIRS, pairs_from, pairs),
            f"{head.wide} from {head.wide_from_rows}": (head.wide, head.wide_from_rows, head.packed_wide)}


@torch.inference_mode()
def main(argv: list[str]) -> None:
    if len(argv) == 4 and not argv[3].isdigit():
        sys.exit("usage: python scripts/jobs/greedy_wide_ab.py [float32] [prompts] [output.json] [rows]")
    rows = int(argv.pop()) if len(argv) == 4 else None
    name, count, output = ab_arguments(argv, "greedy_wide_ab.py")
    if name != "float32" or kernel_isa() != KernelIsa.AVX512_AMX:
        sys.exit("error: the int8 pairs and quads are the AMX tiles' copies of a float32 target's greedy head: "
                 "float32 on AMX")
    torch.set_num_threads(2)
    target, decoders, prompts = int8_tree_decoders(count)
    head, copies = target.engine.greedy_head, arm_copies(target.engine.greedy_head, rows)
    arms = tuple(copies)

    def set_arm(arm: str) -> None:
        head.wide, head.wide_from_rows, head.packed_wide = copies[arm]
    rate = alternating_rates(prompts, arms, set_arm, decoders)
    speedup = {arm: rate[arm, "tree"] / rate[arm, "plain"] for arm in arms}
    print(f"float32, {count} MT-Bench first turns, tokens/s (same tokens in every arm and method):")
    for arm in arms:
        print(f"  {arm}: plain {rate[arm, 'plain']:.2f}, int8 tree {rate[arm, 'tree']:.2f} ({speedup[arm]:.3f}x)")
    write_result(output, count, rate, speedup=speedup)


if __name__ == "__main__":
    main(sys.argv[1:])
