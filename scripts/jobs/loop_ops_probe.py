"""Where a decode round's time goes by op: the goal cells' best method (lookup, else the DFlash tree:
ab_arguments.BEST, or another bench method SPEC) decoding SmolLM2-135M-Instruct float32 on the compiled engine,
MT-Bench first turns after one to warm up, under torch.profiler; each op's self time and calls a round, the most
expensive first, and the round's wall time beside their sum (the rest: Python and what the events leave out). The
profiler adds its own cost to every op: read the ops against each other, not the round's ms against a bench.
    scripts/jobs/quiet.sh python scripts/jobs/loop_ops_probe.py [output.json [SPEC [prompts]]]   (a markdown table
    beside it; an existing output is refused)
"""
import collections
import sys
import time

import torch
from ab_arguments import BEST, float32_targets, method_drafter, probe_output
from torch.profiler import ProfilerActivity, profile

from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.documents import cpu_model, write_document
from draftsmith.eval.prompts import load_prompts
from draftsmith.models.kernels import kernel_isa

SHOWN = 25  # ops in the table (the JSON has every op)


@torch.inference_mode()
def main(argv: list[str]) -> None:
    if len(argv) > 4 or (len(argv) > 3 and not (argv[3].isdigit() and int(argv[3]) >= 2)):
        sys.exit("usage: python scripts/jobs/loop_ops_probe.py [output.json [SPEC [prompts, 2 or more]]]")
    output = probe_output(argv)
    spec = argv[2] if len(argv) > 2 else BEST
    count = int(argv[3]) if len(argv) > 3 else 4
    torch.set_num_threads(2)
    base, target = float32_targets()
    drafter = method_drafter(base, spec)
    decoder = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=128))
    prompts = [p["input_ids"] for p in load_prompts("mt-bench", count, 0, base.tokenizer)]
    decoder.generate(prompts[0])  # loads every package a round uses
    rounds, decode_s = 0, 0.0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for ids in prompts[1:]:
            start = time.perf_counter()
            stats = decoder.generate(ids).stats
            rounds, decode_s = rounds + stats.verify_forwards, decode_s + time.perf_counter() - start - stats.prefill_s
    self_us, calls = collections.Counter(), collections.Counter()
    for event in prof.events():
        self_us[event.name] += event.self_cpu_time_total
        calls[event.name] += 1
    ops = {name: {"ms_a_round": us / rounds / 1000, "calls_a_round": calls[name] / rounds}
           for name, us in self_us.most_common()}
    round_ms, ops_ms = 1000 * decode_s / rounds, sum(op["ms_a_round"] for op in ops.values())
    lines = [f"{cpu_model()} (kernels {kernel_isa()}, 2 threads), {count - 1} MT-Bench first turns after one, "
             f"{rounds} rounds, profiled: a round {round_ms:.2f} ms (prefill apart), its ops' self time "
             f"{ops_ms:.2f}, the rest {round_ms - ops_ms:.2f}", "", f"`{spec}`", "",
             "| op | ms a round | calls a round |", "|---|---|---|"]
    lines += [f"| {name} | {op['ms_a_round']:.3f} | {op['calls_a_round']:.2f} |"
              for name, op in list(ops.items())[:SHOWN]]
    write_document(output, {"cpu": cpu_model(), "kernel_isa": str(kernel_isa()), "spec": spec, "prompts": count - 1,
                            "rounds": rounds, "round_ms": round_ms, "ops": ops}, "\n".join(lines))


if __name__ == "__main__":
    main(sys.argv)
