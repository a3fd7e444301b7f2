"""The library's floors, as docs/layout.md draws them: every import, at a module's top or inside a function, points
down or stays on its floor. Run alone with `python -m pytest tests/test_layers.py`."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module belongs to the longest prefix here that names it.
FLOORS = [
    ["backend.config"],
    ["npu_llm_kernels"],
    ["backend.platform", "backend.distributed", "backend.npu_host"],
    ["backend.models"],
    ["backend.engine"],
    ["backend.triton", "backend.gateway"],
    ["backend.entrypoints", "ui", "loadtest"],
]
# Imports across one floor that are the design: the gateway speaks Triton's contract; Triton never imports the gateway.
SAME_FLOOR_FORBIDDEN = [("backend.triton", "backend.gateway")]


def _floor(module: str) -> tuple[int, str] | None:
    best = None
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (level, prefix)
    return best


def _modules():
    for top in ("backend", "npu_llm_kernels", "ui", "loadtest"):
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            yield name, path


def _imports(path: Path, module: str):
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package up
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            yield from ([f"{base}.{alias.name}" for alias in node.names] if base in ("backend", "ui") else [base])


def test_no_import_points_up():
    upward = []
    for module, path in _modules():
        mine = _floor(module)
        if mine is None:  # backend/__init__.py: the package's face (LLM, SamplingParams), lazily
            continue
        for imported in _imports(path, module):
            theirs = _floor(imported)
            if theirs is None:
                continue
            if theirs[0] > mine[0] or (mine[1], theirs[1]) in SAME_FLOOR_FORBIDDEN:
                upward.append(f"{module} imports {imported}")
    assert not upward, "imports that point up:\n" + "\n".join(sorted(set(upward)))


def test_the_backend_root_holds_the_library_only():
    loose = sorted(p.name for p in (ROOT / "backend").glob("*.py"))
    assert loose == ["__init__.py", "distributed.py", "npu_host.py", "platform.py"], loose
