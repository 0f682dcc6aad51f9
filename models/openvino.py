"""OpenVINO GenAI, pinned, in its own environment: install once, convert models once into the cache, and run a
pipeline (plain, prompt lookup, or a draft model) as a worker process that answers completion requests.

    python -m draftsmith.models.openvino install     # once: a venv in the cache with the pinned wheels (~2 min)

OpenVINO's exporter (optimum-intel) pins transformers below the toolkit's, so the wheels go into a virtual
environment in the cache that sees this environment's torch (--system-site-packages) but has its own transformers.
Models become OpenVINO IR through optimum-intel's own `optimum-cli export openvino`, once per model and weight
format, keyed by the model directory's content; the worker (models/openvino_worker.py) runs in that environment and
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
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import UserError, exit_with
from draftsmith.models.llamacpp import model_dir_key
from draftsmith.models.zoo import draftsmith_cache

# The one OpenVINO stack the toolkit drives (all from PyPI); transformers is the newest optimum-intel 2.2 accepts.
# datasets: optimum-intel imports it, and ours (5.x) needs a newer huggingface_hub than optimum-intel allows.
PINS = ("openvino-genai==2026.4.1.0", "optimum-intel[openvino]==2.2.0", "transformers==5.5.4", "datasets==4.8.5")
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
                        "`python -m draftsmith.models.openvino install` once (~2 min)")


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
    if weight_format not in WEIGHT_FORMATS:
        raise UserError(f"OpenVINO weight format {weight_format!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    require_installed()
    model_dir = Path(model_dir)
    out = home() / "ir" / f"{model_dir.name}-{model_dir_key(model_dir)}-{weight_format}"
    if not (out / "openvino_model.xml").is_file():
        partial = out.with_name(out.name + ".tmp")
        shutil.rmtree(partial, ignore_errors=True)
        run_checked([str(python()), "-m", "optimum.commands.optimum_cli", "export", "openvino", "-m", str(model_dir),
                     "--task", "text-generation-with-past", "--weight-format", weight_format, str(partial)])
        shutil.rmtree(out, ignore_errors=True)
        partial.replace(out)
    return out


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
                "prompt_lookup": s.prompt_lookup}
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
    usage = "usage: python -m draftsmith.models.openvino install"
    if argv != ["install"]:
        raise UserError(f"unknown command {' '.join(argv)!r}: {usage}" if argv else usage)
    print(f"OpenVINO GenAI {RELEASE} installed in {install()}")
    return 0


if __name__ == "__main__":
    exit_with(main)
