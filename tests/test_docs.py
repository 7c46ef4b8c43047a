"""The documentation runs and is complete.

- Every docstring example (doctest) of the public modules runs and prints what it claims.
- Every ```python block of README.md and of every docs/**/*.md page runs: the blocks of one
  page in order, in one namespace, like a notebook. A block whose first line is
  ``# requires: torch`` (module names, comma separated) is skipped when one of them is
  missing; ``transformer_lens<4`` also skips it where the installed major version is 4 or more. Output goes in ```text (or ```console) blocks, which are not run.
- Every public name has an entry (a ``::: jaxtrace.name`` directive) in the API reference,
  docs/api/*.md, so a name added without one fails here.
"""

import ast
import doctest
import importlib
import importlib.metadata
import importlib.util
import pathlib
import re
import textwrap
import types

import jax
import pytest

import jaxtrace

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# dir() and getattr, not vars(): the equinox helpers are loaded on first access.
PUBLIC = {name: getattr(jaxtrace, name) for name in dir(jaxtrace)}
MODULES = sorted({obj.__module__ for obj in PUBLIC.values() if getattr(obj, "__module__", "").startswith("jaxtrace")})


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_every_public_function_has_an_example():
    for name, obj in PUBLIC.items():
        if callable(obj) and not name.startswith("_") and not isinstance(obj, type):
            assert ">>>" in (obj.__doc__ or ""), f"jaxtrace.{name} has no example in its docstring"


def test_torch_module_docstring_examples():
    pytest.importorskip("torch")
    import jaxtrace.torch

    # The package re-exports; doctest reads each function where it is defined.
    modules = {jaxtrace.torch, *(importlib.import_module(getattr(jaxtrace.torch, n).__module__) for n in jaxtrace.torch.__all__)}
    for module in modules:
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0, module.__name__


# --- code blocks of the README and the docs pages ---------------------------------------------

FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```\s*$", re.S | re.M)  # also indented (in a list)
REQUIRES = re.compile(r"\A#\s*requires:\s*([\w., <]+)\n")


def absent_or_too_new(requirement: str) -> str | None:
    """Why a ``# requires:`` entry is not met here (``"torch"``, ``"transformer_lens<4"``), or None."""
    name, _, below = (part.strip() for part in requirement.partition("<"))
    if importlib.util.find_spec(name) is None:
        return name
    if below:
        version = importlib.metadata.version(name)
        if int(version.split(".")[0]) >= int(below):
            return f"{name}<{below} (found {version})"
    return None
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
    """The ```python blocks of a page, with the line each starts on."""
    text = page.read_text()
    return [
        (text.count("\n", 0, m.start()) + 2, textwrap.dedent(m.group(3)))
        for m in FENCE.finditer(text)
        if m.group(2) == "python"
    ]


def test_pages_have_blocks():
    """The block finder finds blocks (a regex that matched nothing would pass every page)."""
    assert len(python_blocks(ROOT / "README.md")) >= 1
    assert sum(len(python_blocks(page)) for page in PAGES) >= 15


# The longest pages (7-15 s each): their blocks run with --long, as .ci/run does. training-statistics.md
# compiles the loss-spike recipe (tests/test_stats.py runs its first block by default).
LONG_PAGES = {"coming-from-transformerlens.md", "coming-from-captum.md", "coming-from-perturb.md", "training-statistics.md", "loss-paths.md"}


TORCH_FAMILY = {"torch", "transformers", "transformer_lens", "captum"}  # on 3.11 only in .ci/run


def _page_marks(page) -> list:
    """``long`` for the longest pages; ``needs_torch`` for a page with a block that ``# requires:`` torch
    or a peer built on it, so that ``--long-torch`` runs it where they are installed."""
    required = {m.group(1) for _, code in python_blocks(page) for m in [REQUIRES.match(code)] if m}
    needs = any(re.split(r"[<\s]", r.strip())[0] in TORCH_FAMILY for rs in required for r in rs.split(","))
    return [pytest.mark.long] * (page.name in LONG_PAGES) + [pytest.mark.needs_torch] * needs


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=_page_marks(p)) for p in PAGES if python_blocks(p)],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_page_code_blocks_run(page, monkeypatch, tmp_path):
    blocks = python_blocks(page)
    monkeypatch.chdir(tmp_path)  # a block that writes a file writes it here
    namespace: dict = {"__name__": "__docs__"}
    x64 = jax.config.jax_enable_x64  # a block may switch it on (the PyTorch guide): restore it
    missing = []
    try:
        for line, code in blocks:
            requires = REQUIRES.match(code)
            needed = [m.strip() for m in requires.group(1).split(",")] if requires else []
            absent = [why for why in map(absent_or_too_new, needed) if why]
            if absent:
                missing.append(f"line {line} needs {', '.join(absent)}")
                continue
            exec(compile("\n" * (line - 1) + code, str(page.relative_to(ROOT)), "exec"), namespace)
    finally:
        jax.config.update("jax_enable_x64", x64)
    if missing:
        pytest.skip("; ".join(missing))


def test_output_blocks_are_marked():
    """A fence without a language is neither run nor highlighted: say python, text or console."""
    for page in PAGES:
        for m in FENCE.finditer(page.read_text()):
            assert m.group(2), f"{page.relative_to(ROOT)}: a ``` block without a language: {m.group(3)[:60]!r}"


# --- the API reference covers every public name -----------------------------------------------


def public_names() -> set[str]:
    """``jaxtrace.X`` for every public name, and ``jaxtrace.M.X`` for each public submodule M.

    A submodule's names are its ``__all__``, else its top-level public functions, classes and
    constants, read from the source (so ``jaxtrace.torch`` counts without torch installed).
    """
    names = {f"jaxtrace.{n}" for n, obj in PUBLIC.items() if not n.startswith("_") and n != "TYPE_CHECKING" and not isinstance(obj, types.ModuleType)}
    for path in sorted([*(ROOT / "jaxtrace").glob("[!_]*.py"), *(ROOT / "jaxtrace").glob("[!_]*/__init__.py")]):
        tree = ast.parse(path.read_text())
        found = None
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                found = set(ast.literal_eval(node.value))
        if found is None:
            found = set()
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    found.add(node.name)
                elif isinstance(node, ast.Assign):
                    found.update(t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper())
            found = {n for n in found if not n.startswith("_")}
        module = path.parent.name if path.name == "__init__.py" else path.stem
        names |= {f"jaxtrace.{module}.{n}" for n in found}
    return names


def test_every_public_name_has_a_reference_entry():
    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented |= set(re.findall(r"^:::\s*(jaxtrace[\w.]*)", page.read_text(), re.M))
    names = public_names()
    assert {"jaxtrace.grad", "jaxtrace.stats.summarize", "jaxtrace.torch.load_weights", "jaxtrace.plot.paths"} <= names
    missing = sorted(names - documented)
    assert not missing, f"public names without an API reference entry (add '::: NAME' to a docs/api/*.md page): {missing}"


def comparison_table(page: pathlib.Path) -> str:
    found = re.search(r"^## How it compares\n\n(\|.*?)(?:\n\n|\Z)", page.read_text(), re.S | re.M)
    assert found, f"{page.relative_to(ROOT)} has no 'How it compares' table"
    return found.group(1).strip()


def test_home_page_has_the_readme_table_and_every_guide():
    """The site's home page and the README compare alike, and the home page links every guide."""
    assert comparison_table(DOCS / "index.md") == comparison_table(ROOT / "README.md")
    home = (DOCS / "index.md").read_text()
    missing = [g.name for g in sorted((DOCS / "guides").glob("*.md")) if f"](guides/{g.name})" not in home]
    assert not missing, f"docs/index.md does not link these guides: {missing}"


SITE = "https://jaxtrace.github.io/jaxtrace/"  # mkdocs.yml's site_url, pyproject's Documentation
REPOSITORY = "https://github.com/jaxtrace/jaxtrace/blob/main/"  # pyproject's Repository


def site_page(url: str) -> pathlib.Path:
    """The docs/ source of a site URL (mkdocs's directory URLs: guides/loss-paths/ is guides/loss-paths.md)."""
    path = url.removeprefix(SITE).split("#")[0].rstrip("/")
    if not path or (DOCS / path / "index.md").exists():
        return DOCS / path / "index.md"
    return DOCS / f"{path}.md"


def test_readme_links_resolve():
    """The README's links are absolute (the package index shows the README, where relative links break):
    site pages that docs/ builds, or files of the repository."""
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)]+)\)", readme)
    assert len(targets) >= 10, "the README links to (almost) no page"
    relative = [t for t in targets if not t.startswith("https://")]
    assert not relative, f"README links by relative path, which break on the package index: {relative}"
    missing = [t for t in targets if t.startswith(SITE) and not site_page(t).exists()]
    missing += [t for t in targets if t.startswith(REPOSITORY) and not (ROOT / t.removeprefix(REPOSITORY).split("#")[0]).exists()]
    assert not missing, f"README links to pages or files that do not exist: {missing}"
