"""One 1536x8960 fp32 Linear (the Qwen2.5-1.5B MLP's up projection) compiled by AOTInductor with weight
freezing and max-autotune: one package per row count (1, 2, 8) vs one package of symbolic rows 1..64
(exported size-obliviously), medians of 30 calls, 2 threads; the evidence for the compiled backend's
shared-width graph (models/compiled.py). Run: scripts/jobs/quiet.sh python scripts/jobs/linear_width_probe.py
"""

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.fx.experimental._config as fx_config
from torch._inductor import aoti_compile_and_package, aoti_load_package

CONFIG = {"freezing": True, "max_autotune": True}


def median_ms(fn, x, calls=30):
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def package(module, example, path, dynamic=None):
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=dynamic is not None):
        program = torch.export.export(module, (example,), dynamic_shapes=dynamic, strict=False)
        aoti_compile_and_package(program, package_path=str(path), inductor_configs=CONFIG)
    return aoti_load_package(str(path))


def main():
    torch.set_num_threads(2)
    torch.manual_seed(0)
    linear = torch.nn.Linear(1536, 8960, bias=False).eval()
    with tempfile.TemporaryDirectory() as tmp:
        shared = package(linear, torch.randn(1, 8, 1536), Path(tmp) / "shared.pt2",
                         dynamic=({1: torch.export.Dim("rows", min=1, max=64)},))
        print("| rows | eager ms | a package per row count ms | one shared package ms |")
        print("|---|---|---|---|")
        for rows in (1, 2, 8):
            x = torch.randn(1, rows, 1536)
            static = package(linear, x, Path(tmp) / f"rows_{rows}.pt2")
            with torch.no_grad():
                print(f"| {rows} | {median_ms(linear, x):.2f} | {median_ms(static, x):.2f} | "
                      f"{median_ms(shared, x):.2f} |", flush=True)


if __name__ == "__main__":
    main()
