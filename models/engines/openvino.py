"""OpenVINO GenAI, pinned, in its own environment: install once, convert models once into the cache, and run a
pipeline (plain, prompt lookup, or a draft model) as a worker process that answers completion requests.

    python -m draftsmith.models.engines.openvino install     # once: a venv in the cache with the pinned wheels (~2 min)

OpenVINO's exporter (optimum-intel) pins transformers below the toolkit's, so the wheels go into a virtual
environment in the cache that sees this environment's torch (--system-site-packages) but has its own transformers.
Models become OpenVINO IR through optimum-intel's own `optimum-cli export openvino`, once per model and weight
format, keyed by the model directory's content; the worker (models/engines/openvino_worker.py) runs in that environment and
speaks llama.cpp's /completion reply shape.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

from draftsmith.errors import UserError, exit_with
from draftsmith.models.engines.llamacpp import model_dir_key
from draftsmith.models.registry import draftsmith_cache

# The one OpenVINO stack the toolkit drives (all from PyPI); transformers is the newest optimum-intel 2.2 accepts.
# datasets: optimum-intel imports it, and ours (5.x) needs a newer huggingface_hub than optimum-intel allows.
# diffusers and einops: optimum-intel's EAGLE-3 draft class lives in a module that imports them (transformers checks
# that a custom model's module imports resolve); huggingface-hub pinned below what diffusers would upgrade it to.
PINS = ("openvino-genai==2026.4.1.0", "optimum-intel[openvino]==2.2.0", "transformers==5.5.4", "datasets==4.8.5",
        "diffusers==0.39.0", "einops==0.8.2", "huggingface-hub==1.21.0")
RELEASE = "2026.4.1"
WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4")  # optimum-cli's --weight-format
MARKER = "installed.json"
WORKER = Path(__file__).with_name("openvino_worker.py")


def home() -> Path:
    return draftsmith_cache() / "openvino" / RELEASE


def python() -> Path:
    return home() / "venv" / "bin" / "python"


def is_installed() -> bool:
    """Whether the venv holds exactly these pins (a venv made with other pins is installed again)."""
    marker = home() / MARKER
    return marker.is_file() and python().is_file() and json.loads(marker.read_text()).get("pins") == list(PINS)


def require_installed() -> None:
    if not is_installed():
        raise UserError(f"OpenVINO GenAI {RELEASE} is not installed in {home()}: run "
                        "`python -m draftsmith.models.engines.openvino install` once (~2 min)")


def install() -> Path:
    """The pinned wheels into a venv in the cache (a no-op when they are there)."""
    if is_installed():
        return home()
    venv = home() / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    run_checked([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    see_this_environment(venv)
    # torch pinned to this environment's own build, so pip keeps it instead of fetching PyPI's 5.5 GB CUDA torch for
    # the torchvision optimum-intel requires; that torchvision (built for CUDA torch) crashes on import beside a CPU
    # torch and the text exporter never needs it, so it goes again.
    this_torch = "torch==" + importlib.metadata.version("torch").split("+")[0]
    run_checked([str(python()), "-m", "pip", "install", "-q", this_torch, *PINS])
    run_checked([str(python()), "-m", "pip", "uninstall", "-y", "-q", "torchvision"])
    (home() / MARKER).write_text(json.dumps({"pins": list(PINS)}) + "\n")
    return home()


def see_this_environment(venv: Path) -> None:
    """Where this Python is itself a virtual environment, --system-site-packages would show the venv the base
    interpreter's packages, not this environment's torch: a .pth file adds this environment's site folders after
    the venv's own (so the venv's pinned transformers still comes first)."""
    if sys.prefix == sys.base_prefix:
        return
    paths = sysconfig.get_paths()
    venv_site = subprocess.run([str(python()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    folders = dict.fromkeys([paths["purelib"], paths["platlib"]])
    (Path(venv_site) / "draftsmith_parent_environment.pth").write_text("".join(f"{folder}\n" for folder in folders))


def run_checked(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"`{' '.join(command[:4])} ...` failed: {last[0]}")


def cached_ir(model_dir: Path, weight_format: str = "fp32") -> Path:
    """The OpenVINO IR of an HF model directory (and its tokenizer), exported once by optimum-intel into the
    cache, keyed by the directory's content and the weight format."""
    model_dir = Path(model_dir)
    out = ir_path(model_dir, weight_format)
    if not (out / "openvino_model.xml").is_file():
        export_ir(model_dir, out, weight_format)
    return out


def ir_path(model_dir: Path, weight_format: str) -> Path:
    if weight_format not in WEIGHT_FORMATS:
        raise UserError(f"OpenVINO weight format {weight_format!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    require_installed()
    return home() / "ir" / f"{model_dir.name}-{model_dir_key(model_dir)}-{weight_format}"


def export_ir(source: Path, out: Path, weight_format: str, *extra: str, finish=None) -> None:
    """optimum-cli's export of `source` into `out` (through a partial folder, so a failed export leaves nothing);
    `finish(partial)` edits the export before it takes its place."""
    partial = out.with_name(out.name + ".tmp")
    shutil.rmtree(partial, ignore_errors=True)
    run_checked([str(python()), "-m", "optimum.commands.optimum_cli", "export", "openvino", "-m", str(source),
                 "--task", "text-generation-with-past", "--weight-format", weight_format, *extra, str(partial)])
    if finish is not None:
        finish(partial)
    shutil.rmtree(out, ignore_errors=True)
    partial.replace(out)


# ---------------------------------------------------------------------------------------------
# EAGLE-3 drafters
# ---------------------------------------------------------------------------------------------

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # the SGLang/SpecForge layout, which optimum-intel exports
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "vocab", "merges", "chat_template")  # the target's, beside it


def eagle3_feature_layers(eagle3_dir: Path) -> list[int]:
    """The target layers an EAGLE-3 export in the SGLang layout reads (decoder-layer inputs); refuses in one line
    any other folder."""
    config_file = Path(eagle3_dir) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if EAGLE3_ARCHITECTURE not in config.get("architectures", []):
        raise UserError(f"{eagle3_dir} is not an EAGLE-3 drafter in the SGLang layout (architectures "
                        f"[{EAGLE3_ARCHITECTURE}]), which optimum-intel exports for OpenVINO: write one with "
                        "`python scripts/export.py dgf <final> <out> --layout sglang`")
    return list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])


def openvino_hidden_layers(feature_layers: list[int]) -> list[int]:
    """OpenVINO GenAI taps the output of decoder layer i (its `layers.i` MLP residual sum); the EAGLE-3 layouts name
    the input of layer i, the output of layer i - 1."""
    return [layer - 1 for layer in feature_layers]


def cached_eagle3_ir(eagle3_dir: Path, target_dir: Path, weight_format: str = "fp32") -> Path:
    """The OpenVINO IR of an EAGLE-3 drafter (SGLang layout), exported once by optimum-intel into the cache with the
    target's tokenizer, the target layers it reads written into the IR's runtime info (`hidden_layers_list`, where
    OpenVINO GenAI looks; `eagle3_mode` is optimum-intel's). OpenVINO GenAI then runs it as an EAGLE-3 draft model:
    the target's embedding is shared into it and its fc moves onto the target's tapped layers at load time.
    optimum-cli's --trust-remote-code loads optimum-intel's own EAGLE-3 class (no code from the drafter's folder)."""
    eagle3_dir = Path(eagle3_dir)
    layers = openvino_hidden_layers(eagle3_feature_layers(eagle3_dir))
    out = ir_path(eagle3_dir, weight_format)
    if (out / "openvino_model.xml").is_file():
        return out
    with tempfile.TemporaryDirectory() as staging:
        source = Path(staging)
        for file in [*eagle3_dir.glob("*.safetensors"), eagle3_dir / "config.json",
                     *(file for file in Path(target_dir).iterdir() if file.name.startswith(TOKENIZER_FILES))]:
            (source / file.name).symlink_to(file.resolve())
        export_ir(source, out, weight_format, "--trust-remote-code",
                  finish=lambda partial: set_runtime_info(partial / "openvino_model.xml", "hidden_layers_list",
                                                          " ".join(map(str, layers))))
    return out


def set_runtime_info(model_xml: Path, name: str, value: str) -> None:
    """Set `<rt_info><name value=...>` of an IR's XML (read by OpenVINO as the model's runtime info)."""
    tree = ElementTree.parse(model_xml)
    info = tree.getroot().find("rt_info")
    if info is None:
        info = ElementTree.SubElement(tree.getroot(), "rt_info")
    entry = info.find(name)
    if entry is None:
        entry = ElementTree.SubElement(info, name)
    entry.set("value", value)
    tree.write(model_xml, encoding="utf-8", xml_declaration=True)


def ir_weights_bytes(ir: Path) -> int:
    return sum(file.stat().st_size for file in Path(ir).glob("openvino_model*.bin"))


@dataclass(frozen=True)
class PipelineSettings:
    """One OpenVINO GenAI pipeline: the target's IR, threads, and a draft model's IR or prompt lookup."""

    model: Path
    threads: int = 2
    draft: Path | None = None
    prompt_lookup: bool = False
    generation: dict = field(default_factory=dict)  # GenerationConfig fields every request sets
    precision: str = "f32"  # INFERENCE_PRECISION_HINT of target and draft: OpenVINO's own default is bf16 on a CPU with it


class OpenVinoWorker:
    """`with OpenVinoWorker(settings) as worker: worker.complete(ids, 128)` -> llama.cpp's /completion reply."""

    def __init__(self, settings: PipelineSettings, log_path: Path | None = None):
        self.settings = settings
        self.log_path = log_path or home() / "worker.log"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "OpenVinoWorker":
        require_installed()
        s = self.settings
        spec = {"model": str(s.model), "threads": s.threads, "draft": str(s.draft) if s.draft else None,
                "prompt_lookup": s.prompt_lookup, "precision": s.precision}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # -P: the worker's folder (models/, which holds this openvino.py) must not shadow the `openvino` package
        self.process = subprocess.Popen([str(python()), "-P", str(WORKER), json.dumps(spec)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=open(self.log_path, "w"), text=True)
        self.read_reply()
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            with contextlib.suppress(BrokenPipeError):  # a worker that died (killed for memory) says so in read_reply
                self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
            self.process = None

    def memory_bytes(self) -> int:
        """What the worker holds: OpenVINO's CPU plugin copies the IR's weights into each process (measured: 6.7 GB
        for the fp32 1.5B), so the target's and the draft's weight files, per worker."""
        return sum(ir_weights_bytes(ir) for ir in (self.settings.model, self.settings.draft) if ir is not None)

    def read_reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            tail = self.log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
            raise UserError(f"the OpenVINO worker stopped ({self.log_path}): {tail[0]}")
        reply = json.loads(line)
        if "error" in reply:
            raise UserError(f"OpenVINO GenAI refused the request: {reply['error']}")
        return reply

    def complete(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        request = {"ids": list(prompt_ids), "max_new_tokens": max_new_tokens, "generation": self.settings.generation}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self.read_reply()


def main(argv: list[str]) -> int:
    usage = "usage: python -m draftsmith.models.engines.openvino install"
    if argv != ["install"]:
        raise UserError(f"unknown command {' '.join(argv)!r}: {usage}" if argv else usage)
    print(f"OpenVINO GenAI {RELEASE} installed in {install()}")
    return 0


if __name__ == "__main__":
    exit_with(main)
