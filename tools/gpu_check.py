"""Is this GPU machine ready? One command: every CUDA test (`pytest -m cuda tests`: those marked `cuda` in any test
file; the ones that need two GPUs skip on one), then the optimizer benchmark on the GPU, summed up in one JSON line
printed last. Installs nothing and needs no virtual environment:
only this repo and a Python with torch and torchvision (pytest too, for the tests).

    python3 tools/gpu_check.py        (or: make gpu-check [PYTHON=/path/to/python])

Without a visible CUDA device it prints one line and exits 0. Exit code 1 when a CUDA test failed or could not
run, or the benchmark broke.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = "tests"
BENCH = "bench/optim_step.py"


def run_tests() -> dict:
    """The CUDA tests under pytest, output shown as it comes; counts from pytest's JUnit report."""
    if importlib.util.find_spec("pytest") is None:
        print(f"gpu-check: pytest is not installed for {sys.executable}: CUDA tests not run, benchmark only")
        return {"ran": False, "reason": "pytest not installed"}
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "cuda.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "cuda",
            TESTS,
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
        ]
        print("gpu-check: " + " ".join(command[1:]), flush=True)
        exit_code = subprocess.run(command, cwd=REPO).returncode
        if not report.is_file():
            return {"ran": False, "reason": f"pytest exited {exit_code} without a report", "failed": 1}
        return junit_counts(ElementTree.parse(report).getroot()) | {"exit_code": exit_code}


def junit_counts(root: ElementTree.Element) -> dict:
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = sum(int(s.get("tests", 0)) for s in suites)
    counts = {key: sum(int(s.get(attribute, 0)) for s in suites) for key, attribute in
              (("failed", "failures"), ("errors", "errors"), ("skipped", "skipped"))}  # fmt: skip
    broken = [
        f"{case.get('classname', '')}::{case.get('name', '')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {"ran": True, "passed": total - sum(counts.values())} | counts | {"failing": broken}


def run_bench() -> dict:
    """bench/optim_step.py --device cuda, its lines shown as they come; its last line is its JSON summary."""
    command = [sys.executable, BENCH, "--device", "cuda"]
    print("gpu-check: " + " ".join(command[1:]), flush=True)
    # the machine's own Python has no `pip install -e .` of this repo: the repo goes on its path instead
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    last = ""
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True, env=env) as process:
        for line in process.stdout:
            print(line, end="", flush=True)
            last = line.strip() or last
    if process.returncode != 0:
        return {"error": f"{BENCH} exited {process.returncode}"}
    try:
        return json.loads(last)
    except json.JSONDecodeError:
        return {"error": f"{BENCH} did not end with a JSON line"}


def nvidia_device_nodes() -> bool:
    """Whether this machine shows an NVIDIA GPU to its processes, asked without torch."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def main() -> int:
    try:
        import torch
    except ImportError:
        if not nvidia_device_nodes():
            print(f"gpu-check: no CUDA device visible (no torch for {sys.executable}); nothing to check")
            return 0
        print(f"gpu-check: {sys.executable} cannot import torch; name a Python that has it: make gpu-check PYTHON=...")
        return 2
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device visible (torch {version}); nothing to check")
        return 0
    tests = run_tests()
    bench = run_bench()
    summary = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "tests": tests,
        "bench": bench,
    }
    print(json.dumps(summary))
    return 1 if tests.get("failed", 0) or tests.get("errors", 0) or "error" in bench else 0


if __name__ == "__main__":
    sys.exit(main())
