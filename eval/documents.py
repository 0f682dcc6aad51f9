"""What every measuring command shares: the machine it ran on (CPU model and vector ISA, memory stalls), its
command line (a config whose `output` is one JSON document, refused when it exists unless --overwrite) and how
the document is written (the JSON, and the table printed and kept beside it as .md)."""

from __future__ import annotations

import platform
from pathlib import Path

from draftsmith.config import command_parser, parse_command
from draftsmith.fileio import atomic_write, atomic_write_json, refuse_overwrite


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isa() -> str:
    """The widest vector arithmetic this CPU lists (Linux /proc/cpuinfo; the machine kinds here time differently
    because of it), as `isa_name` names it."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        flags = []
    return isa_name(flags)


def isa_name(flags: list[str]) -> str:
    """"AVX-512 with BF16", "AVX-512", "AVX2" or "other", with "+AMX" where the flags list AMX tiles."""
    isa = ("AVX-512 with BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags
           else "AVX2" if "avx2" in flags else "other")
    return isa + ("+AMX" if "amx_tile" in flags else "")


def machine_kind(model: str | None = None, isa: str | None = None) -> str:
    """The machine kind results are kept per, as a file-name part: `intel_xeon`, `amd_epyc_zen4` (an EPYC with
    AVX-512), `amd_epyc_avx2`; another CPU is named by its model and vector arithmetic (`cpu_model`, `cpu_isa`)."""
    model, isa = model or cpu_model(), isa or cpu_isa()
    if "Xeon" in model:
        return "intel_xeon"
    if "EPYC" in model:
        return "amd_epyc_zen4" if isa.startswith("AVX-512") else "amd_epyc_avx2"
    words = "".join(c if c.isalnum() else " " for c in f"{model} {isa}").lower().split()
    return "_".join(words)


def memory_stall_seconds(pressure_file: Path = Path("/proc/pressure/memory")) -> float | None:
    """Seconds, since boot, in which some task of this machine stalled waiting for memory (reclaim, or re-reading
    evicted pages: Linux PSI's `some total`), or None where the kernel does not report it. The difference over a
    timed loop says whether its timings include paging (a bench whose models outgrow the RAM)."""
    try:
        for line in pressure_file.read_text().splitlines():
            if line.startswith("some"):
                return int(line.rsplit("total=", 1)[1]) / 1e6
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_line(info: dict) -> str:
    return f"{info['processor']}, {info['cpu_count']} cores, {info['torch_threads']} torch threads, torch {info['torch']}"


def parse_document_command(module: str, doc: str, config_cls, argv: list[str]):
    """(config, output path or None) of a command that writes one JSON document to `config.output` (refused
    when it exists, unless --overwrite)."""
    parser = command_parser(f"python -m {module}", doc.split("\n\n")[0], config_cls)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    config, flags = parse_command(parser, config_cls, argv)
    out = Path(config.output) if config.output else None
    if out is not None:
        refuse_overwrite(out, flags.overwrite)
    return config, out


def write_document(out: Path | None, document: dict, table: str) -> None:
    """Print the table; with `out`, write the JSON there and the table beside it (.md)."""
    print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out, document)
        atomic_write(out.with_suffix(".md"), lambda path: path.write_text(table + "\n"))
        print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":  # `python -m draftsmith.eval.documents`: this machine's kind (the job scripts' folder names)
    print(machine_kind())
