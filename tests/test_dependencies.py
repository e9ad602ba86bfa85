"""Every third-party module the package imports comes from a declared runtime dependency (or one
of theirs): the README's serve command installs the package without its test extras, so an
import satisfied only by a test dependency would work in the suite and fail for a user."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _canonical(re.match(r"[A-Za-z0-9_.-]+", requirement)[0])


def _runtime_closure() -> set[str]:
    """The declared runtime dependencies and, installed here, what they require in turn (extras
    and platform markers aside: an extra is not installed by a plain install)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        pending = [_requirement_name(r) for r in tomllib.load(f)["project"]["dependencies"]]
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            continue
        pending += [_requirement_name(r) for r in reqs if "extra ==" not in r]
    return seen


def _imported_modules(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def test_every_module_the_package_imports_comes_with_a_runtime_dependency():
    closure = _runtime_closure()
    providers = packages_distributions()
    missing = {}
    for path in sorted([*(ROOT / "llmserve").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]):
        for top in _imported_modules(path):
            if top in sys.stdlib_module_names or top in ("llmserve", "__future__"):
                continue
            if not {_canonical(d) for d in providers.get(top, [])} & closure:
                missing.setdefault(top, str(path.relative_to(ROOT)))
    assert not missing, f"imported but not from a runtime dependency in pyproject.toml: {missing}"
