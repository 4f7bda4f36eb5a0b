"""The project's dependencies other than torch, for a GPU node without network: collected into
a folder of wheels where the package index is reachable, installed from it on the node.

    python -m tools.gpu_check.wheels download --wheels DIR --python 3.12   # `make wheels`
    python -m tools.gpu_check.wheels install --env .venv-gpu-check --wheels DIR

`download`: `pip download --only-binary=:all:` of requirements.txt without torch (the site's)
and without DALI (its wheel names a CUDA version; `--extra` adds it), for CPython of
`--python` on manylinux x86_64 (glibc 2.17 to `--glibc`), plus pip's own wheel, and a
manifest (MANIFEST) saying what the folder is for. It runs on Python >= 3.7 (`make wheels`
checks that first: this file does not parse on older ones) with pip >= MIN_PIP, which
takes the repeated `--platform` it gives.

`install`, run by the interpreter that will run the checks (the site's Python, PY): the
requirements PY lacks (absent, or a version the requirement refuses) and only those, from
the folder, offline (`--no-index`), into a venv beside the site's environment, which is
often read-only. The venv is made from PY's base interpreter with `--system-site-packages`
and a `.pth` file naming PY's own site directories: a venv made with
`--system-site-packages` from another venv sees only the base interpreter's packages, not
that venv's (where a site's torch may live). pip there resolves against what PY already has
and adds only what is missing. Prints, as its last line, the interpreter to run the checks
with: PY itself when nothing is missing. Bad input (a folder made for another Python, a
wheel missing from it, nothing given while something is missing) is one `error:` line,
exit 2.

Standard library only: it runs before the dependencies it installs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MANIFEST = "gpu-check-wheels.json"
SOURCE = "gpu-check-source.json"  # in the venv: which interpreter it extends
# The site brings these: torch (its own build), DALI (a wheel per CUDA version: --extra).
SITE_OR_OPTIONAL = ("torch", "nvidia-dali-")
USER_ERROR = 2
# pip takes --platform more than once from 20.3 (pypa/pip#8820); older ones keep the last.
MIN_PIP = (20, 3)


class WheelsError(Exception):
    """One line for the user (exit 2)."""


def canonical(name: str) -> str:
    """A distribution's name as wheel files and indexes compare it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str:
    return canonical(re.split(r"[\s<>=!~;\[]", line.strip(), maxsplit=1)[0])


def project_requirements(path: Path = REPO / "requirements.txt",
                         extra: Sequence[str] = ()) -> list[str]:
    """The requirement lines of `path` (following `-r`), without the site's torch and the
    optional DALI, plus `extra`."""
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            lines += project_requirements(path.parent / line[3:].strip())
            continue
        if not requirement_name(line).startswith(SITE_OR_OPTIONAL):
            lines.append(line)
    return lines + list(extra)


# ----------------------------------------------------------------------------- download

def platforms(glibc: str) -> list[str]:
    """manylinux x86_64 tags a node with glibc `glibc` runs: 2.17 (manylinux2014) up."""
    major, minor = (int(p) for p in glibc.split("."))
    if (major, minor) < (2, 17):
        raise WheelsError(f"--glibc {glibc}: expected 2.17 or newer (manylinux2014)")
    return ([f"manylinux_{major}_{m}_x86_64" for m in range(minor, 16, -1)]
            + ["manylinux2014_x86_64"])


def download_command(folder: Path, python: str, glibc: str, requirements: Sequence[str],
                     pip: Sequence[str] = (sys.executable, "-m", "pip")) -> list[str]:
    if not re.fullmatch(r"3\.\d+", python):
        raise WheelsError(f"--python {python}: expected a Python version such as 3.12")
    command = [*pip, "download", "--only-binary=:all:", "--dest", str(folder),
               "--python-version", python, "--implementation", "cp"]
    for tag in platforms(glibc):
        command += ["--platform", tag]
    return command + ["pip", *requirements]


def pip_problem(version_line: str, python: str = sys.executable) -> str | None:
    """Why the pip that printed `version_line` (`pip --version`) cannot make the folder,
    or None: it is missing, or older than MIN_PIP."""
    found = re.match(r"pip (\d+)\.(\d+)", version_line.strip())
    upgrade = f"{python} -m pip install --upgrade pip, or give another PYTHON=<python>"
    if not found:
        return f"{python} has no pip (make wheels runs `{python} -m pip download`): {upgrade}"
    if (int(found.group(1)), int(found.group(2))) < MIN_PIP:
        return (f"pip {found.group(1)}.{found.group(2)} of {python} keeps one --platform "
                f"only; make wheels gives several (manylinux 2.17 to the nodes' glibc) and "
                f"needs pip >= {'.'.join(map(str, MIN_PIP))}: {upgrade}")
    return None


def download(folder: Path, python: str, glibc: str, requirements: Sequence[str]) -> None:
    """`make wheels`: the wheels of `requirements` (and their dependencies, and pip) for
    CPython `python` on manylinux x86_64 into `folder`, and the MANIFEST."""
    version = subprocess.run([sys.executable, "-m", "pip", "--version"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    problem = pip_problem(version.stdout if version.returncode == 0 else "")
    if problem:
        raise WheelsError(problem)
    folder.mkdir(parents=True, exist_ok=True)
    command = download_command(folder, python, glibc, requirements)
    print(" ".join(command), flush=True)
    proc = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise WheelsError(f"pip download failed ({pip_reason(proc.stderr)}): is the package "
                          "index reachable from here? make wheels runs where it is")
    (folder / MANIFEST).write_text(json.dumps({
        "python": python, "glibc": glibc, "platforms": platforms(glibc),
        "requirements": list(requirements),
        "made": datetime.now(timezone.utc).isoformat(timespec="seconds")}, indent=1))
    wheels = sorted(p.name for p in folder.glob("*.whl"))
    print(f"{len(wheels)} wheels in {folder} for Python {python} (manylinux x86_64, glibc "
          f"<= {glibc}); on the GPU node: make gpu-check PY=python3 WHEELS={folder}")


def pip_reason(stderr: str) -> str:
    """pip's own reason, in one line."""
    found = re.search(r"No matching distribution found for (\S+)", stderr)
    if found:
        return f"no wheel of {found.group(1)} for this Python and platform"
    lines = [line.strip() for line in stderr.splitlines()
             if line.strip() and not line.startswith("WARNING")]
    return lines[-1] if lines else "no message"


# ----------------------------------------------------------------------------- install

def _requirement(line: str):  # noqa: ANN202 - packaging's Requirement, or None
    """The parsed requirement, by the `packaging` that pip vendors if no other is there;
    None where neither exists (then presence alone counts)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        try:
            from pip._vendor.packaging.requirements import Requirement
        except ImportError:
            return None
    return Requirement(line)


def unmet(requirements: Sequence[str]) -> list[str]:
    """The requirements this interpreter does not satisfy: absent, or a version the
    requirement's specifier refuses."""
    from importlib import metadata  # Python >= 3.8: the install's PY has torch, so >= 3.9

    missing = []
    for line in requirements:
        try:
            version = metadata.version(requirement_name(line))
        except metadata.PackageNotFoundError:
            missing.append(line)
            continue
        req = _requirement(line)
        if req is not None and not req.specifier.contains(version, prereleases=True):
            missing.append(line)
    return missing


def wheel_names(folder: Path) -> set[str]:
    """The distributions a folder holds wheels of."""
    return {canonical(p.name.split("-", 1)[0]) for p in folder.glob("*.whl")}


def check_folder(folder: Path, missing: Sequence[str]) -> None:
    """One line if the folder is not there, was made for another Python, or lacks a wheel
    of something missing."""
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    remake = f"make wheels WHEELS={folder} WHEELS_PYTHON={here} where the index is reachable"
    if not folder.is_dir():
        raise WheelsError(f"WHEELS={folder}: no such folder; {remake}")
    manifest = folder / MANIFEST
    if manifest.is_file():
        made_for = json.loads(manifest.read_text()).get("python")
        if made_for and made_for != here:
            raise WheelsError(f"WHEELS={folder} holds wheels for Python {made_for}, but "
                              f"{sys.executable} is Python {here}; {remake}")
    absent = sorted({requirement_name(r) for r in missing} - wheel_names(folder))
    if absent:
        raise WheelsError(f"WHEELS={folder} has no wheel of {', '.join(absent)}, which "
                          f"{sys.executable} lacks; {remake}")


def site_dirs() -> list[str]:
    """This interpreter's own site directories (a venv's, the base's, the user's): what
    the gpu-check venv must see besides its own."""
    import site

    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def make_env(env: Path) -> Path:
    """The venv extending this interpreter (module docstring): made once, made again if it
    extends another interpreter. Returns its python."""
    python = env / "bin" / "python"
    source = {"python": sys.executable, "version": sys.version, "site": site_dirs()}
    marker = env / SOURCE
    if python.exists() and marker.is_file() and json.loads(marker.read_text()) == source:
        return python
    shutil.rmtree(env, ignore_errors=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--system-site-packages", "--without-pip", str(env)],
                   check=True)
    (purelib(python) / "gpu_check_site.pth").write_text("\n".join(source["site"]) + "\n")
    marker.write_text(json.dumps(source))
    return python


def purelib(python: Path) -> Path:
    """Where `python` installs pure-Python packages (a venv's site-packages)."""
    return Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())


def pip_in(python: Path, folder: Path) -> list[str]:
    """How to run pip for `python`: its own (seen through the site's directories), else
    the pip wheel in the folder (a wheel on the path runs as pip)."""
    has_pip = subprocess.run([str(python), "-c", "import pip"], capture_output=True)
    if has_pip.returncode == 0:
        return [str(python), "-m", "pip"]
    wheels = sorted(folder.glob("pip-*.whl"))
    if not wheels:
        raise WheelsError(f"{sys.executable} has no pip and WHEELS={folder} no pip wheel; "
                          "make wheels puts one there")
    return [str(python), str(wheels[-1] / "pip")]


def install(env: Path, folder: Path | None, requirements: Sequence[str]) -> str:
    """The interpreter to run the checks with, after installing what this one lacks."""
    missing = unmet(requirements)
    if not missing:
        print(f"gpu-check: {sys.executable} has every dependency", file=sys.stderr)
        return sys.executable
    names = ", ".join(requirement_name(r) for r in missing)
    if folder is None:
        raise WheelsError(f"{sys.executable} lacks {names}: make wheels WHEELS=<folder> "
                          "where the package index is reachable, then make gpu-check "
                          "PY=... WHEELS=<folder>")
    check_folder(folder, missing)
    python = make_env(env)
    command = [*pip_in(python, folder), "install", "--no-index", "--find-links",
               str(folder), "--quiet", "--disable-pip-version-check", *missing]
    print(f"gpu-check: installing {names} from {folder} into {env}", file=sys.stderr,
          flush=True)
    proc = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise WheelsError(f"installing from WHEELS={folder} failed: {pip_reason(proc.stderr)}")
    shadowed = shadowed_by(python)
    if shadowed:
        print(f"warning: the venv's {', '.join(shadowed)} hide the site's (a requirement "
              "refused its version)", file=sys.stderr)
    return str(python)


def shadowed_by(python: Path) -> list[str]:
    """Distributions installed into the venv of `python` that this interpreter also has."""
    from importlib import metadata

    mine = {canonical(d.metadata["Name"]) for d in metadata.distributions()}
    theirs = {canonical(d.metadata["Name"])
              for d in metadata.distributions(path=[str(purelib(python))])}
    return sorted(theirs & mine)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help="make wheels")
    d.add_argument("--wheels", type=Path, required=True)
    d.add_argument("--python", default=f"{sys.version_info[0]}.{sys.version_info[1]}")
    d.add_argument("--glibc", default="2.28", help="the oldest glibc of the GPU nodes")
    i = sub.add_parser("install", help="what this interpreter lacks, from the folder")
    i.add_argument("--env", type=Path, required=True, help="the venv to install into")
    i.add_argument("--wheels", type=Path, default=None)
    for q in (d, i):
        q.add_argument("--requirements", type=Path, default=REPO / "requirements.txt")
        q.add_argument("--extra", nargs="*", default=[], help="more requirements (DALI)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        requirements = project_requirements(args.requirements, args.extra)
        if args.command == "download":
            download(args.wheels, args.python, args.glibc, requirements)
        else:
            print(install(args.env, args.wheels, requirements))
    except WheelsError as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
