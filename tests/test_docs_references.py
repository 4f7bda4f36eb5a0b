"""The README, tests/README.md and docs/*.md cite only what exists: every file path, every
link and every `package.module.name` they write must be there, so the docs cannot drift
from the code unnoticed. One test per page; a failure lists every broken reference of it.

What counts as a reference, in inline code, fenced code blocks (commands are cited too) and
markdown links:
  - a path: a word with a '/' whose first part is a directory of the repository, any word
    with a '/' that ends in a repository file type (REPO_SUFFIXES), or a bare file name of
    code or config (CODE_SUFFIXES: `train.py`, `Makefile` is not one). It must exist
    relative to the repository root, to the page's own directory (tests/README.md cites
    `helpers.py`), or, in a table row whose first cell is a directory (`training/`), to that
    directory (the README's "What is where" names each folder's files by their names);
  - a dotted name whose first part is one of the project's packages or scripts
    (`utils.precision.Precision`, `bench.bench_step`, `train.train`): a module, a package,
    or a name bound in a module (def, class, assignment, import) or in a class body (also
    `self.<name>` in its methods). Resolved from the source, without importing it: the unit
    tier stays free of torch imports, and a module whose own imports fail is reported by the
    tests that import it, not as a docs problem. A name re-exported by `from x import y` is
    followed into x;
  - a markdown link to a file, and its `#anchor`: a heading of the target page, as GitHub
    makes anchors.

Left out, on purpose (a placeholder or a run's output is not a claim about the repository):
  - what exists only after a run or a `make` target: paths under RUNTIME_DIRS (`logs/...`,
    `data/...`, `.venv/...`), and bare names of other file types (`skill.csv`, `out.log`,
    `ckpt_00001200.pt`, `rollout_t2m.png`: files a run writes);
  - paths outside the repository (`/scratch/era5_like`, `~/...`) and URLs;
  - words with placeholder or shell syntax (PLACEHOLDER: `<run dir>/profile`, `$LOG_DIR/...`,
    `%j`, globs, `[_rank<R>]`, `{...}`);
  - dotted names that start elsewhere (`torch.compile`, `comm.get_size`, `cfg.lr`).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path, PurePosixPath

import pytest
from helpers import REPO

PAGES = ["README.md", "tests/README.md",
         *(f"docs/{p.name}" for p in sorted((REPO / "docs").glob("*.md")))]

PACKAGES = {"utils", "data", "networks", "distributed", "evaluation", "training", "bench", "tools"}
SCRIPTS = {"train", "train_mp", "train_mp_graphs", "inference"}
REPO_SUFFIXES = {".py", ".sh", ".md", ".yaml", ".toml", ".txt", ".png"}
CODE_SUFFIXES = {".py", ".sh", ".md", ".yaml", ".toml", ".txt"}
# Last parts of a dotted word that make it a file name, not a module path (`inference.log`).
FILE_TYPES = {s.lstrip(".") for s in REPO_SUFFIXES} | {
    "log", "csv", "json", "pt", "npy", "h5", "out", "yml", "cfg", "ini", "html", "whl"}
RUNTIME_DIRS = {"logs", "datasets", ".venv"}
PLACEHOLDER = set("<>$%*?{}[]~@") | {"...", "://"}

FENCE = re.compile(r"^(```+)[^\n]*\n(.*?)^\1\s*$", re.M | re.S)
INLINE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
WORD_SPLIT = re.compile(r"[\s=,;()\"'|]+")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


# ----------------------------------------------------------------------------- a page

def code_of(text: str) -> list[str]:
    """The fenced code blocks and inline code spans of a page."""
    fences = [m.group(2) for m in FENCE.finditer(text)]
    return [*fences, *(m.group(2) for m in INLINE.finditer(FENCE.sub("\n", text)))]


def words(code: str) -> list[str]:
    """The words of a code span or block that could be a path or a dotted name."""
    out = []
    for word in WORD_SPLIT.split(code):
        word = word.strip(".:`")
        if word.startswith("./"):
            word = word[2:]
        if word:
            out.append(word)
    return out


# ----------------------------------------------------------------------------- paths

def path_reason(word: str, *bases: Path) -> str | None:
    """Why `word` is not a path the repository has, relative to the repository root or to
    one of `bases` (None: it is, or it is not a path)."""
    if any(p in word for p in PLACEHOLDER) or word.startswith(("/", "-")):
        return None
    parts = word.rstrip("/").split("/")
    suffix = PurePosixPath(parts[-1]).suffix
    if len(parts) == 1:
        is_path = suffix in CODE_SUFFIXES and not is_project_name(word)
    else:
        is_path = suffix in REPO_SUFFIXES or (REPO / parts[0]).is_dir()
    if not is_path or parts[0] in RUNTIME_DIRS:
        return None
    if any((base / word).exists() for base in (REPO, *bases)):
        return None
    return "no such file or directory"


def is_project_name(word: str) -> bool:
    """`word` is a dotted name of the project whose last part is not a file type."""
    return bool(DOTTED.fullmatch(word)) and word.split(".")[0] in PACKAGES | SCRIPTS and \
        word.rsplit(".", 1)[1] not in FILE_TYPES


# ----------------------------------------------------------------------------- dotted names

@functools.cache
def module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def self_attributes(method: ast.AST) -> dict[str, ast.AST]:
    """`self.<name> = ...` assignments in a method."""
    names: dict[str, ast.AST] = {}
    for sub in ast.walk(method):
        targets = sub.targets if isinstance(sub, ast.Assign) else \
            [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and \
                    t.value.id == "self":
                names.setdefault(t.attr, sub)
    return names


def bound_by(node: ast.stmt) -> dict[str, ast.AST]:
    """The names one statement binds (an import from: one ImportFrom per name, so that a
    re-export can be followed)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name: node}
    if isinstance(node, ast.Assign):
        return {n.id: node for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id: node}
    if isinstance(node, ast.Import):
        return {a.asname or a.name.split(".")[0]: node for a in node.names}
    if isinstance(node, ast.ImportFrom):
        return {a.asname or a.name: ast.ImportFrom(module=node.module, names=[a],
                                                   level=node.level) for a in node.names}
    return {}


def bindings(body: list[ast.stmt], in_class: bool = False) -> dict[str, ast.AST]:
    """Names bound by these statements (`if`/`try` bodies included); in a class, also
    `self.<name> = ...` in its methods."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.If, ast.Try)):
            nested = [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                      *(s for h in getattr(node, "handlers", []) for s in h.body)]
            names.update(bindings(nested, in_class))
            continue
        if in_class and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for name, sub in self_attributes(node).items():
                names.setdefault(name, sub)
        names.update(bound_by(node))
    return names


def name_reason(path: Path, names: list[str], shown: str) -> str | None:
    """Why `names` (a.b.c) are not bound in the module at `path`."""
    body, in_class = module_tree(path).body, False
    for i, name in enumerate(names):
        node = bindings(body, in_class).get(name)
        if node is None:
            where = ".".join([shown, *names[:i]])
            return f"{where} has no {name!r}"
        rest = names[i + 1:]
        if not rest:
            return None
        if isinstance(node, ast.ClassDef):
            body, in_class = node.body, True
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and \
                node.module.split(".")[0] in PACKAGES | SCRIPTS:
            return dotted_reason(".".join([node.module, node.names[0].name, *rest]))
        else:
            return None  # an attribute of a value: not checked statically
    return None


def dotted_reason(dotted: str) -> str | None:
    """Why `dotted` is not a module, package or bound name of the project (None: it is)."""
    parts, path = dotted.split("."), REPO
    for i, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
            continue
        if (path / f"{part}.py").is_file():
            return name_reason(path / f"{part}.py", parts[i + 1:], ".".join(parts[:i + 1]))
        missing = f"no module, package or name {'.'.join(parts[:i + 1])}"
        if i > 0 and (path / "__init__.py").is_file():  # a name the package binds
            package = ".".join(parts[:i])
            why = name_reason(path / "__init__.py", parts[i:], package)
            return missing if why == f"{package} has no {part!r}" else why
        return missing
    return None


# ----------------------------------------------------------------------------- links

def slug(heading: str) -> str:
    """GitHub's anchor of a heading: code and link markup dropped, lower case, punctuation
    other than '-' and '_' removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@functools.cache
def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("\n", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def link_reason(target: str, page: Path) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
        return None
    file, _, anchor = target.partition("#")
    dest = (page.parent / file).resolve() if file else page
    if not dest.exists():
        return "no such file or directory"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{dest.relative_to(REPO)} has no heading with anchor #{anchor}"
    return None


# ----------------------------------------------------------------------------- the test

def row_directory(line: str) -> Path | None:
    """The directory a table row is about: its first cell's code span, if that ends in '/'."""
    if not line.startswith("|"):
        return None
    first = INLINE.search(line.split("|")[1])
    if first and first.group(2).endswith("/") and (REPO / first.group(2)).is_dir():
        return REPO / first.group(2)
    return None


def reason(word: str, *bases: Path) -> str | None:
    """Why a word of code is a broken reference (None: it is fine, or no reference)."""
    return dotted_reason(word) if is_project_name(word) else path_reason(word, *bases)


def broken_references(page: str) -> list[str]:
    path = REPO / page
    text = path.read_text()
    rows: dict[str, list[Path]] = {}
    for line in FENCE.sub("\n", text).splitlines():
        if directory := row_directory(line):
            for span in INLINE.findall(line):
                for w in words(span[1]):
                    rows.setdefault(w, []).append(directory)
    problems = []
    for word in dict.fromkeys(w for code in code_of(text) for w in words(code)):
        if why := reason(word, path.parent, *rows.get(word, [])):
            problems.append(f"`{word}`: {why}")
    for target in dict.fromkeys(LINK.findall(text)):
        if why := link_reason(target, path):
            problems.append(f"link ({target}): {why}")
    return problems


@pytest.mark.parametrize("page", PAGES)
def test_every_path_name_and_link_the_page_cites_exists(page):
    problems = broken_references(page)
    assert not problems, f"{page} cites what does not exist:\n  " + "\n  ".join(problems)


def test_the_check_tells_broken_references_from_the_rest():
    """The checker itself, on a sample of each kind of word, good, broken and left out."""
    sample = ("`utils/precision.py`, `utils/no_such.py`, `utils.precision.Precision`, "
              "`utils.precision.Precision.autocast`, `utils.precision.nothing`, "
              "`networks.build_model(cfg)`, `train.train`, `inference.log`, `tests/README.md`, "
              "`logs/cpu_short/1CPU/00`, `<run dir>/x.py`, `torch.compile`, "
              "`distributed.fft.Modes`, `Loss/train`, `m2/s2`, `skill.csv`, `/scratch/x.py`\n"
              "```bash\npython -m bench.bench_nothing --config x  # writes notes.md\n```\n")
    found = {w: reason(w, REPO / "docs") for code in code_of(sample) for w in words(code)}
    assert {w for w, why in found.items() if why} == \
        {"utils/no_such.py", "utils.precision.nothing", "bench.bench_nothing", "notes.md"}
    assert found["utils.precision.nothing"] == "utils.precision has no 'nothing'"
    assert found["bench.bench_nothing"] == "no module, package or name bench.bench_nothing"
    assert link_reason("runs.md#checkpoints", REPO / "docs" / "baseline.md") is None
    assert "no heading" in link_reason("runs.md#nowhere", REPO / "docs" / "baseline.md")
    assert link_reason("nowhere.md", REPO / "docs" / "baseline.md") == \
        "no such file or directory"
    assert slug("6. Fused Adam and `torch.compile`") == "6-fused-adam-and-torchcompile"
    assert slug("Before the first GPU run: `make test-gpu`") == \
        "before-the-first-gpu-run-make-test-gpu"
