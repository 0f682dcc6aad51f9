"""The lent-GPU job's `unpack` (scripts/jobs/device_families_smollm2.sh): a resumed long run's files from the device
go on after the committed ones, once, however often the same files are unpacked."""
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parents[1] / "scripts" / "jobs"
KEPT = Path("drafters/student6_smollm2_human_long")


def metrics_lines(steps):
    return "".join(json.dumps({"step": step, "train/loss": 1.0}) + "\n" for step in steps)


def write_pack(folder: Path, files: dict) -> None:
    """The device's pack of run `student`: a gzipped tar split in parts, as `blocks` leaves it in $OUT."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "student.tar.gz.aa").write_bytes(buffer.getvalue())


@pytest.fixture
def checkout(tmp_path):
    """A git checkout holding the job, its helper and a committed long run of 3 logged steps."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "checkout"
    (root / "scripts" / "jobs").mkdir(parents=True)
    for name in ("device_families_smollm2.sh", "newest.sh"):
        shutil.copy(JOBS / name, root / "scripts" / "jobs" / name)
    (root / KEPT).mkdir(parents=True)
    (root / KEPT / "metrics.jsonl").write_text(metrics_lines([10, 20, 30]))
    (root / KEPT / "train.log").write_text("step 30 loss 1.0\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    return root


def unpack(checkout: Path, folder: Path) -> None:
    subprocess.run(["bash", "scripts/jobs/device_families_smollm2.sh", "unpack", str(folder)], cwd=checkout,
                   check=True, capture_output=True)


def test_a_resumed_run_goes_on_after_the_committed_steps_once(checkout, tmp_path):
    pack = tmp_path / "files"
    write_pack(pack, {"metrics.jsonl": metrics_lines([30, 40, 50]),
                      "train.log": "resumed from step_30\nstep 50 loss 0.9\n"})
    unpack(checkout, pack)
    unpack(checkout, pack)  # the same files again: nothing more
    steps = [json.loads(line)["step"] for line in (checkout / KEPT / "metrics.jsonl").read_text().splitlines()]
    assert steps == [10, 20, 30, 40, 50]
    assert (checkout / KEPT / "train.log").read_text() == "step 30 loss 1.0\nresumed from step_30\nstep 50 loss 0.9\n"
