"""scripts/jobs/quiet.sh: pauses background data/training jobs while a timing command runs, never the
command's own processes, and continues them afterwards, also when it is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

QUIET = Path(__file__).resolve().parents[1] / "scripts" / "jobs" / "quiet.sh"


def state(pid: int) -> str:
    return subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()[:1]


def start_fake_job(tmp_path: Path) -> subprocess.Popen:
    """A process whose command line looks like a regeneration job."""
    script = tmp_path / "draftsmith.data.regenerate_fake.py"
    script.write_text("import time\nwhile True:\n    time.sleep(0.1)\n")
    return subprocess.Popen([sys.executable, str(script)], start_new_session=True)


def test_quiet_pauses_jobs_but_not_its_own_command_and_continues_them(tmp_path):
    job = start_fake_job(tmp_path)
    try:
        time.sleep(0.5)
        own = f"{sys.executable} {tmp_path / 'draftsmith.data.regenerate_fake.py'}"
        # the command's own process sleeps between its loop's steps: wait (with a deadline) for a sample that finds it
        # asleep, since one sample under load can catch it runnable; a paused process would read T every time
        own_state = "s=$(ps -o stat= -p $C | cut -c1)"
        probe = (f"{own} & C=$!; sleep 3; for i in $(seq 40); do {own_state}; [ \"$s\" = S ] && break; sleep 0.25; "
                 f"done; echo own=$s job=$(ps -o stat= -p {job.pid} | cut -c1); kill $C; exit 3")
        done = subprocess.run(["bash", str(QUIET), "bash", "-c", probe], capture_output=True, text=True, timeout=60)
        assert done.returncode == 3 and "own=S job=T" in done.stdout
        assert state(job.pid) in {"S", "R"}
    finally:
        os.kill(job.pid, signal.SIGCONT)
        job.kill()


def test_killing_quiet_continues_the_jobs_at_once(tmp_path):
    job = start_fake_job(tmp_path)
    try:
        time.sleep(0.5)
        quiet = subprocess.Popen(["bash", str(QUIET), "sleep", "60"], start_new_session=True)
        time.sleep(3)
        assert state(job.pid) == "T"
        quiet.terminate()
        assert quiet.wait(timeout=10) == 143
        time.sleep(0.5)
        assert state(job.pid) in {"S", "R"}
    finally:
        os.kill(job.pid, signal.SIGCONT)
        job.kill()


def test_the_machine_kind_runner_lists_its_steps_and_what_is_done():
    """scripts/jobs/machine_kind_smollm2.sh list: every per-kind step in priority order with its output and state,
    under the folders of this machine's kind; ONLY picks steps. (Running them is the benches' own business.)"""
    from draftsmith.eval.documents import machine_kind

    runner = QUIET.with_name("machine_kind_smollm2.sh")
    listed = subprocess.run(["bash", str(runner), "list"], capture_output=True, text=True, check=True).stdout
    assert f"machine kind: {machine_kind()}" in listed
    names = [line.split()[0] for line in listed.splitlines()[1:]]
    assert names[:2] == ["roofline_float32", "roofline_w8a8"] and names[-1] == "sampling"
    assert {"goal_float32", "engines", "exports", "medusa_bench", "trees", "llamacpp_blocks"} <= set(names)
    # the profile the table's ARCA rows read (of the continued Medusa heads) is measured right before the table
    assert names.index("arca_profile") + 1 == names.index("arca_profile_regen")
    assert names.index("arca_profile_regen") + 1 == names.index("families_table_latest") < names.index("medusa_bench")
    states = {line.split()[1] for line in listed.splitlines()[1:]}
    assert states <= {"done", "to-do", "set-up", "not-here"}
    only = subprocess.run(["bash", str(runner), "list"], capture_output=True, text=True, check=True,
                          env=os.environ | {"ONLY": "trees"}).stdout
    assert [line.split()[0] for line in only.splitlines()[1:]] == ["trees"]


def test_each_runner_step_hands_its_config_to_the_tool_that_reads_it():
    """A per-kind step that names a config file runs the module whose config type accepts that file's keys (a llama.cpp
    bench's config given to the PyTorch bench stopped a run at its first line)."""
    import re

    from draftsmith.config import load_config
    from draftsmith.eval.bench.run import BenchConfig
    from draftsmith.eval.engines.llamacpp_bench import LlamaCppBenchConfig
    from draftsmith.eval.engines.openvino_bench import OpenVinoBenchConfig

    readers = {"$BENCH": BenchConfig, "with_kind_profile": BenchConfig,
               "python -m draftsmith.eval.bench": BenchConfig,
               "python -m draftsmith.eval.engines.llamacpp_bench": LlamaCppBenchConfig,
               "python -m draftsmith.eval.engines.openvino_bench": OpenVinoBenchConfig}
    runner = QUIET.with_name("machine_kind_smollm2.sh").read_text()
    steps = re.findall(r'^  "(\w+)\|[^|]*\|[01]\|(.*)"$', runner, flags=re.MULTILINE)
    checked = 0
    for name, command in steps:
        found = re.search(r"(\$BENCH|with_kind_profile|python -m [\w.]+)(?: --config)? (eval/configs/\S+\.yaml)", command)
        if found is None:
            continue
        reader = readers.get(found.group(1))
        assert reader is not None, f"{name}: no config type known for {found.group(1)}"
        load_config(reader, QUIET.parents[2] / found.group(2))
        checked += 1
    assert checked >= 15
