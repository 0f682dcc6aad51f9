"""Every default is declared once: the default target (models/bundled.py DEFAULT_TARGET), the draft-tree budget
limit (eval/decode/decoder.py BUDGET_LIMIT). A literal copy in a config's option() would drift from it."""

from __future__ import annotations

import ast
from pathlib import Path

from draftsmith.eval.bench.run import BenchConfig
from draftsmith.eval.decode.decoder import BUDGET_LIMIT, DecodeConfig
from draftsmith.eval.arca_profile import ProfileConfig
from draftsmith.models.bundled import DEFAULT_TARGET

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ["draftsmith", "models", "data", "eval", "train", "scripts"]


def option_defaults() -> list[tuple[str, int, object]]:
    """(file, line, default) of every option(<literal>, ...) call in the package's sources."""
    found = []
    for folder in PACKAGE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "option" and node.args
                        and isinstance(node.args[0], ast.Constant)):
                    found.append((str(path.relative_to(ROOT)), node.lineno, node.args[0].value))
    return found


def test_default_target_is_declared_once():
    copies = [(path, line) for path, line, value in option_defaults() if value == DEFAULT_TARGET]
    assert not copies, f"option({DEFAULT_TARGET!r}, ...) written out; use models.bundled.DEFAULT_TARGET: {copies}"


def test_budget_limit_is_declared_once():
    assert DecodeConfig().budget_limit == BenchConfig().budget_limit == ProfileConfig().calibration_budget == BUDGET_LIMIT
    copies = [(path, line) for path, line, value in option_defaults() if value == BUDGET_LIMIT]
    assert not copies, f"option({BUDGET_LIMIT}, ...) written out; use eval.decode.decoder.BUDGET_LIMIT: {copies}"


def test_every_bench_shares_one_prompt_section():
    from draftsmith.eval.engines.common import EngineBenchConfig
    from draftsmith.eval.engines.llamacpp_bench import LlamaCppBenchConfig
    from draftsmith.eval.engines.openvino_bench import OpenVinoBenchConfig
    from draftsmith.eval.prompts import PromptSettings

    for config in (BenchConfig, EngineBenchConfig, LlamaCppBenchConfig, OpenVinoBenchConfig):
        assert issubclass(config, PromptSettings), config
    assert BenchConfig().max_new_tokens == OpenVinoBenchConfig().max_new_tokens == PromptSettings().max_new_tokens


def test_every_benchmark_protocol_loads_with_the_command_it_names():
    """eval/configs/*.yaml: each names its command on a `# Run: python -m draftsmith.eval.<bench> --config <file>`
    line, and that command's config loads it (methods parsed, every key known)."""
    from draftsmith.config import load_config
    from draftsmith.eval.engines.llamacpp_bench import LlamaCppBenchConfig
    from draftsmith.eval.engines.openvino_bench import OpenVinoBenchConfig

    commands = {"draftsmith.eval.bench": BenchConfig, "draftsmith.eval.engines.llamacpp_bench": LlamaCppBenchConfig,
                "draftsmith.eval.engines.openvino_bench": OpenVinoBenchConfig}
    protocols = sorted((ROOT / "eval" / "configs").glob("*.yaml"))
    assert len(protocols) >= 8
    for path in protocols:
        run = [line for line in path.read_text().splitlines() if line.startswith("# Run: python -m ")]
        assert run, f"{path.name} names no command (# Run: python -m ...)"
        module = run[0].split()[4]
        assert f"--config eval/configs/{path.name}" in run[0], f"{path.name}: its Run line runs another file"
        load_config(commands[module], path)
