"""Every method spec the project writes or shows parses: the specs exports record, the bench's defaults, the
commands in README.md and RESULTS.md, and the trees in the bundled drafters' manifests (the student export once
wrote `lm-chain:k=4`, which the parser had stopped accepting)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from draftsmith.config import list_words, parse_override
from draftsmith.eval.bench.run import default_methods
from draftsmith.eval.engines.llamacpp_bench import LlamaCppMethodSpec
from draftsmith.eval.engines.openvino_bench import OpenVinoMethodSpec
from draftsmith.eval.bench.methods import MethodSpec, parse_method
from draftsmith.models.trees import DGF_TREE, LM_CHAIN_SPEC, LM_TREE_SPEC, TreeShape

ROOT = Path(__file__).resolve().parents[1]


def documented_specs() -> list[tuple[type, str]]:
    """(the spec type of the command on that line, spec) for every `methods=` in README.md and RESULTS.md; a line
    continued with a backslash belongs to the command it continues."""
    specs = []
    for doc in ("README.md", "RESULTS.md"):
        continued = None
        for line in (ROOT / doc).read_text().splitlines():
            kind = continued or (LlamaCppMethodSpec if "llamacpp_bench" in line else
                                 OpenVinoMethodSpec if "openvino_bench" in line else MethodSpec)
            for match in re.finditer(r'methods=("[^"]*"|\S+)', line):
                _, value = parse_override("methods=" + match.group(1).strip("\"'`"))  # as the command reads it
                specs += [(kind, spec) for spec in (value if isinstance(value, list) else list_words(value))]
            continued = kind if line.rstrip().endswith("\\") else None
    return specs


@pytest.mark.parametrize("kind,spec", [(MethodSpec, LM_CHAIN_SPEC), (MethodSpec, LM_TREE_SPEC), *documented_specs()])
def test_every_written_spec_parses(kind, spec):
    assert str(kind.from_config(spec)) == spec


def test_bench_defaults_parse_back():
    for spec in default_methods("smollm2-135m-instruct"):
        assert str(parse_method(str(spec))) == str(spec)


def test_bundled_manifest_trees_read_with_either_budget_key():
    for manifest in (ROOT / "models" / "bundled").glob("*/export_manifest.json"):
        tree = json.loads(manifest.read_text())["tree"]
        shape = TreeShape.from_manifest(tree, DGF_TREE)
        assert shape.budget == tree.get("budget", tree.get("g"))
    assert TreeShape.from_manifest({"depth": 2, "g": 5}, DGF_TREE) == TreeShape(2, DGF_TREE.topk, 5)
    assert TreeShape.from_manifest(DGF_TREE.to_manifest(), DGF_TREE) == DGF_TREE


def test_one_grammar_for_methods_sources_and_tiny_models():
    from draftsmith.data.sources import _parse_spec
    from draftsmith.models.tiny import TinySpec, parse_tiny_spec
    from draftsmith.specs import SpecText, parse_spec

    assert parse_spec("dgf:outputs/run/final,budget=5") == SpecText("dgf", "outputs/run/final", {"budget": "5"})
    assert parse_spec("union:drafters=[(ngram:budget=6),dgf]").options == {"drafters": "[(ngram:budget=6),dgf]"}
    assert _parse_spec("gsm8k:train,limit=3") == ("gsm8k", {"split": "train", "limit": 3})
    assert _parse_spec("hf:org/data,split=test") == ("hf", {"name_or_path": "org/data", "split": "test"})
    assert parse_tiny_spec("tiny:qwen2,seed=3") == TinySpec("qwen2", 3) and parse_tiny_spec("tiny:llama").seed == 0
    assert parse_method("medusa:outputs/x,budget=8").options.path == "outputs/x"


@pytest.mark.parametrize("load,spec,words", [
    ("method", "lm-chain:budget=4,budget=5", "given twice"),
    ("method", "lm-chain:4", "use key=value"),
    ("method", "union:drafters=[(ngram", "unbalanced"),
    ("source", "gsm8k:train,limit=(3", "unbalanced"),
    ("source", "gsm8k:train,test", "only the first item"),
    ("source", "python-source,limit=2", "`python-source:key=value`"),
    ("method", "ngram,budget=4", "`ngram:key=value`"),
    ("method", "topk=3", "is an option, not a spec"),  # `methods=[lm-tree:depth=4,topk=3]` read as YAML
    ("method", "cascade:drafters=[]", "at least one drafter"),
    ("method", "union:drafters=[]", "at least one drafter"),
    ("tiny", "tiny:llama,seed=x", "seed=<integer>"),
    ("tiny", "tiny:llama,size=3", "seed=<integer>")])
def test_one_error_style(load, spec, words):
    from draftsmith.config import ConfigError
    from draftsmith.data.sources import load_source
    from draftsmith.errors import UserError, one_line
    from draftsmith.models.tiny import parse_tiny_spec

    call = {"method": parse_method, "source": load_source, "tiny": parse_tiny_spec}[load]
    with pytest.raises((UserError, ConfigError)) as err:
        call(spec)
    assert words in one_line(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("text,methods", [
    ("cascade:drafters=[(ngram), (lm-chain:budget=4)]", ["cascade:drafters=[(ngram), (lm-chain:budget=4)]"]),
    ("[cascade:drafters=[ngram]]", ["cascade:drafters=[ngram]"]),  # YAML does not read it as a list
    ("[ngram, cascade:drafters=[(ngram), lm-chain]]", ["ngram", "cascade:drafters=[(ngram), lm-chain]"]),
    ("ngram, lm-chain", ["ngram", "lm-chain"]),
    ("['lm-tree:depth=4,topk=3', ngram]", ["lm-tree:depth=4,topk=3", "ngram"])])
def test_a_list_of_methods_on_the_command_line(text, methods):
    """Specs split at spaces outside brackets (a nested list's spaces stay in its spec), with or without brackets
    around the list."""
    from draftsmith.config import load_config
    from draftsmith.eval.bench.run import BenchConfig

    config = load_config(BenchConfig, overrides=["target=tiny:llama", f"methods={text}"])
    assert [str(spec) for spec in config.methods[2:]] == methods


def test_feature_drafter_dtype_option():
    """`dgf:dtype=bfloat16` runs the drafter in bf16 beside any target (the target verifies: lossless either way);
    another dtype is refused in one line."""
    spec = parse_method("cascade:drafters=[(ngram:min_n=2), (dgf:depth=6,topk=2,budget=8,dtype=bfloat16)]")
    assert spec.options.drafters[1].options.dtype == "bfloat16"
    assert parse_method("dgf").options.dtype is None
    with pytest.raises(ValueError, match="dtype"):
        parse_method("dgf:dtype=float16")


def test_a_labelled_method_reads_back_and_keeps_its_spec(tmp_path):
    """`{method: ..., label: ...}` shows a long spec as a short table label; the printed config reads back, a
    YAML anchor repeats one drafter in several composites, and the mapping form's label is its compact spec."""
    from draftsmith.config import config_to_dict, load_config
    from draftsmith.eval.bench.run import BenchConfig

    path = tmp_path / "bench.yaml"
    path.write_text("methods:\n"
                    "  - method: {cascade: {drafters: ['ngram:min_n=3,budget=8', &tree 'dgf:depth=4,topk=3']}}\n"
                    "    label: lookup on 3-grams, else the tree\n"
                    "  - cascade: {drafters: ['ngram:min_n=2', *tree]}\n"
                    "  - {method: 'ngram:min_n=3'}\n")
    config = load_config(BenchConfig, path)
    labelled, mapped, bare = config.methods[2:]
    assert str(labelled) == "lookup on 3-grams, else the tree"
    assert labelled.text == "cascade:drafters=[(ngram:min_n=3,budget=8), (dgf:depth=4,topk=3)]"
    assert str(mapped) == "cascade:drafters=[(ngram:min_n=2), (dgf:depth=4,topk=3)]"
    assert str(parse_method(str(mapped))) == str(mapped) and str(bare) == "ngram:min_n=3" and bare.text is None
    assert labelled.options.drafters[1] == mapped.options.drafters[1]
    written = config_to_dict(config)["methods"]
    assert written[2] == {"method": labelled.text, "label": labelled.label}
    again = tmp_path / "again.yaml"
    again.write_text(json.dumps({"methods": written}))
    assert load_config(BenchConfig, again).methods == config.methods
    sized = parse_method({"method": "ngram:n=2", "label": "lookup"}).replace(budget=5)  # a budget sweep's point
    assert (sized.label, sized.text, sized.options.budget) == ("lookup:budget=5", "ngram:n=2,budget=5", 5)


@pytest.mark.parametrize("methods,words", [
    ("[ngram, ngram]", "'ngram' is listed twice"),
    ("[{method: ngram, label: plain}]", "'plain' is listed twice"),
    ("[{method: ngram, label: 'a | b'}]", "methods[0].label: 'a | b': give one line"),
    ("[{method: ngram, lable: x}]", "unknown key 'lable' beside `method`"),
    ("[{method: 'ngram:nn=2', label: x}]", "methods[0].method: method 'ngram:nn=2'"),
])
def test_a_method_label_is_one_short_line_shown_once(tmp_path, methods, words):
    from draftsmith.config import ConfigError, load_config
    from draftsmith.eval.bench.run import BenchConfig

    path = tmp_path / "bench.yaml"
    path.write_text(f"methods: {methods}\n")
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(BenchConfig, path)
