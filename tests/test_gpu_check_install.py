"""`make gpu-check` and `make wheels` as a user runs them, without a GPU and without network:

  - on a machine without a GPU, `make gpu-check` says so in one line and exits 2, before it
    installs anything (and so does `python -m tools.gpu_check`);
  - `make wheels` without a Python >= 3.7 says so in one line and exits 2;
  - `make wheels` collects the wheels of the requirements and of their dependencies (and
    pip's own) into the folder, with its manifest: pip downloads from a local folder here
    (PIP_NO_INDEX, PIP_FIND_LINKS), the same command it runs against the index;
  - the install, by an interpreter that has torch (this one) and lacks the requirements:
    only those, from the folder, offline, into a venv of its own, which sees this
    interpreter's packages (torch from a venv included) through its .pth; a requirement
    without a wheel in the folder is one `error:` line, exit 2.
The requirements are two small wheels made here (one depending on the other). About 10 s.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import REPO, child_env

from tools.gpu_check.wheels import MANIFEST

pytestmark = pytest.mark.e2e


def make_wheel(folder: Path, name: str, requires: list[str]) -> Path:
    """A pure-Python wheel of `name` 1.0 whose module holds NAME = its name."""
    module, dist = name.replace("-", "_"), name.replace("-", "_") + "-1.0"
    files = {f"{module}/__init__.py": f"NAME = {name!r}\n",
             f"{dist}.dist-info/METADATA": "Metadata-Version: 2.1\nName: " + name +
             "\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
             "Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
    wheel = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def run(command: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=child_env(env), capture_output=True,
                          text=True, timeout=300)


def test_without_a_gpu_make_gpu_check_says_so_in_one_line_and_installs_nothing(tmp_path):
    env_dir = tmp_path / "env"
    proc = run(["make", "--no-print-directory", "gpu-check", f"PY={sys.executable}",
                f"GPU_CHECK_ENV={env_dir}", f"WHEELS={tmp_path}"], CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    ours = [line for line in proc.stderr.splitlines() if not line.startswith("make")]
    assert len(ours) == 1 and ours[0].startswith("error: no GPU: PyTorch "), proc.stderr
    assert "sees no CUDA device; run make gpu-check on a GPU node" in ours[0]
    assert not env_dir.exists()  # stopped before installing
    direct = run([sys.executable, "-m", "tools.gpu_check"], CUDA_VISIBLE_DEVICES="")
    assert direct.returncode == 2 and direct.stderr.strip() == ours[0], direct.stderr


def test_make_wheels_without_a_python_of_at_least_3_7_is_one_line(tmp_path):
    """The check runs before the download's code, which an older Python cannot parse
    (a missing interpreter here; an old one is refused by the same line)."""
    made = run(["make", "--no-print-directory", "wheels", f"WHEELS={tmp_path / 'w'}",
                f"PYTHON={tmp_path / 'python'}"])
    assert made.returncode == 2, made.stdout + made.stderr
    ours = [line for line in made.stderr.splitlines() if not line.startswith("make")]
    assert ours == [f"error: make wheels needs Python >= 3.7 (with pip >= 20.3), and "
                    f"PYTHON={tmp_path / 'python'} is not found: give one as PYTHON=<python>"]
    assert not (tmp_path / "w").exists()


def test_make_wheels_then_an_offline_install_of_only_what_the_interpreter_lacks(tmp_path):
    source, folder = tmp_path / "index", tmp_path / "wheels"
    source.mkdir()
    make_wheel(source, "gpucheck-probe-a", ["gpucheck-probe-b>=1"])
    make_wheel(source, "gpucheck-probe-b", [])
    import ensurepip

    for pip_wheel in Path(ensurepip.__file__).parent.glob("_bundled/pip-*.whl"):
        shutil.copy(pip_wheel, source)  # the index's pip, for make wheels to collect
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("torch==0.0.1  # the site's: never collected\ngpucheck-probe-a>=1.0\n")
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    made = run(["make", "--no-print-directory", "wheels", f"WHEELS={folder}",
                f"WHEELS_REQUIREMENTS={requirements}", f"PYTHON={sys.executable}"],
               PIP_NO_INDEX="1", PIP_FIND_LINKS=str(source))
    assert made.returncode == 0, made.stdout + made.stderr
    names = sorted(p.name.split("-")[0] for p in folder.glob("*.whl"))
    assert names == ["gpucheck_probe_a", "gpucheck_probe_b", "pip"], names
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["python"] == here and manifest["requirements"] == ["gpucheck-probe-a>=1.0"]

    env_dir = tmp_path / "env"
    install = [sys.executable, "-m", "tools.gpu_check.wheels", "install", "--env",
               str(env_dir), "--wheels", str(folder), "--requirements", str(requirements)]
    first = run(install, PIP_INDEX_URL="http://127.0.0.1:9/unreachable")
    assert first.returncode == 0, first.stderr
    python = first.stdout.strip().splitlines()[-1]
    assert python == str(env_dir / "bin" / "python")
    assert "installing gpucheck-probe-a from" in first.stderr  # b came as its dependency
    probe = run([python, "-c", "import gpucheck_probe_a, gpucheck_probe_b, torch; "
                 "print(gpucheck_probe_b.NAME, torch.__version__)"])
    assert probe.returncode == 0, probe.stderr  # torch: this interpreter's, through the .pth
    import torch

    assert probe.stdout.split() == ["gpucheck-probe-b", torch.__version__]
    again = run(install)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == python

    requirements.write_text("gpucheck-probe-c\n")
    missing = run(install)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert missing.stderr.startswith(f"error: WHEELS={folder} has no wheel of "
                                     "gpucheck-probe-c")
