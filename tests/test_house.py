"""The package's shape: no import cycle, the swarm server never loads the client, short functions."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "continuous"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the package that ``name`` imports anywhere in its text (functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
            # "from . import x" names a module when x is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def test_no_import_cycle():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert {"continuous.decode.grid", "continuous.heal"} <= graph["continuous.decode.loop"]
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_import_walk_sees_function_level_and_relative_imports():
    known = {"continuous.a": Path("a.py"), "continuous.b": Path("b.py"), "continuous.c": Path("c.py")}
    source = "from . import b\ndef f():\n    from .c import x\n"
    path = Path(__file__).parent / "_walk_probe.py"
    path.write_text(source)
    try:
        assert imports("continuous.a", path, known) == {"continuous.b", "continuous.c"}
    finally:
        path.unlink()


def test_the_swarm_server_never_loads_the_client():
    code = ("import sys, continuous.remote.server.server, continuous.remote.server.__main__; "
            "print(sorted(m for m in sys.modules if m.startswith(('continuous.remote.client', 'continuous.wrapper', "
            "'continuous.decode', 'continuous.generate'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def functions():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("limit", [100])
def test_functions_fit_on_a_screen(limit):
    long = [f"{where} ({n} lines)" for where, n in functions() if n > limit]
    assert not long, long
