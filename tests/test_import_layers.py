"""Import structure of the four packages (DESIGN.md "Layers: imports point down, never up"), read with `ast` only.

1. The module-level import graph has no cycle. `import a.b` imports a.b; `from pkg import name` imports pkg, and
   pkg.name where that is a module; relative imports resolve against the importing module's package.
2. At most MAX_LOCAL_IMPORTS function-local imports of project modules remain (CLI lazy imports, the known layer
   composition in convert's command, the lazy `kimi_jax` package attributes).
3. Layer rules: pallas_kernels imports no other project package; sharding imports only pallas_kernels and itself;
   convert never imports the model — of kimi_jax only the config, which describes what both sides share — except
   its command (`convert.__main__`), which takes the target shapes from the loader; kimi_jax.modules never imports
   the engine or the server.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kimi_jax", "pallas_kernels", "sharding", "convert")
MAX_LOCAL_IMPORTS = 30


def _modules() -> dict:
    """module name -> (path, is_package)."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


MODULES = _modules()


def _project(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _targets(module: str, is_pkg: bool, node) -> list[str]:
    """The project modules an import statement imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if _project(a.name)]
    base = node.module or ""
    if node.level:
        pkg = module.split(".") if is_pkg else module.split(".")[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    if not _project(base):
        return []
    return [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]


def _scan():
    """(module-level graph {module: set of modules}, [(module, line, targets)] of function-local project imports)."""
    graph, local = {}, []
    for module, (path, is_pkg) in MODULES.items():
        edges = set()

        def walk(node, in_function):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    targets = _targets(module, is_pkg, child)
                    if in_function and targets:
                        local.append((module, child.lineno, targets))
                    elif not in_function:
                        edges.update(targets)
                walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        walk(ast.parse(path.read_text(), str(path)), False)
        edges.discard(module)  # a package's __init__ importing its own names / submodules (`from . import x`)
        graph[module] = edges
    return graph, local


GRAPH, LOCAL = _scan()


def _find_cycle(graph: dict):
    """One cycle as [m0, m1, ..., m0], or None (iterative DFS, white / grey / black)."""
    state = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack, path = [(start, iter(sorted(graph[start])))], [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next((m for m in it if m in graph and state.get(m) != 2), None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            else:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def test_the_scan_sees_the_packages():
    assert len(MODULES) > 80 and "kimi_jax.model" in GRAPH and "sharding.moe" in GRAPH
    assert "kimi_jax.modules.decoder" in GRAPH["kimi_jax.model"]


def test_no_module_level_import_cycle():
    cycle = _find_cycle(GRAPH)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_few_function_local_project_imports():
    listing = "\n".join(f"  {m}:{line} -> {', '.join(t)}" for m, line, t in LOCAL)
    assert len(LOCAL) <= MAX_LOCAL_IMPORTS, (f"{len(LOCAL)} function-local imports of project modules (at most "
                                             f"{MAX_LOCAL_IMPORTS}); import at module level:\n{listing}")


def _offenders(package: str, allowed, *, local_too: bool = True, forbidden=None) -> list[str]:
    found = []
    edges = [(m, None, t) for m, ts in GRAPH.items() for t in ts]
    if local_too:
        edges += [(m, line, t) for m, line, ts in LOCAL for t in ts]
    for m, line, t in edges:
        if m != package and not m.startswith(package + "."):
            continue
        bad = (not t.startswith(allowed)) if forbidden is None else t.startswith(forbidden)
        if bad:
            found.append(f"{m}{'' if line is None else f':{line} (in a function)'} imports {t}")
    return sorted(set(found))


def test_pallas_kernels_import_no_other_project_package():
    assert _offenders("pallas_kernels", ("pallas_kernels",)) == []


def test_sharding_imports_only_pallas_kernels_and_itself():
    assert _offenders("sharding", ("sharding", "pallas_kernels")) == []


def test_convert_never_imports_the_model():
    # The converter sits below the model (DESIGN.md): its plan takes the target shapes as input. Only the command
    # composes the two, asking the loader (kimi_jax.checkpoint) for them.
    shared = ("kimi_jax", "kimi_jax.config")
    found = [f for f in _offenders("convert", None, forbidden="kimi_jax") if f.split(" imports ")[1] not in shared]
    assert all(f.startswith("convert.__main__:") and f.endswith(" imports kimi_jax.checkpoint") for f in found), found


def test_modules_never_import_engine_or_serve():
    assert _offenders("kimi_jax.modules", None, forbidden=("kimi_jax.engine", "kimi_jax.serve")) == []
