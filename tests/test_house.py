"""The house rules a reader can check by eye, checked by Python's `ast`: the modules inside engine/ and inside app/
import each other without a circle, and no class is over 250 lines and no function over 80."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "app")
LONGEST_CLASS = 250
LONGEST_FUNCTION = 80


def modules(package: str) -> dict[str, ast.Module]:
    """Every module of `package` by its dotted name (`engine.wim`; `engine` for its __init__.py), parsed."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return out


def imported(name: str, tree: ast.Module, is_package: bool, known: set[str]) -> set[str]:
    """The modules among `known` that module `name` imports anywhere in it (at the top, inside functions, under
    `if TYPE_CHECKING:`), whether written `from .x import y`, `from . import x`, `from engine.x import y` or
    `import engine.x`."""
    here = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `engine.x.y` imports `engine.x` where y is a name in it
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle in `graph` (module -> the modules it imports), as the modules along it, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            found = visit(nxt, path + [node])
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return None


def import_graph(package: str) -> dict[str, set[str]]:
    """Each module of `package` -> the modules of `package` it imports. The package's own __init__ only re-exports
    its modules' public names for outside callers, so it is left out (engine.wim's `from . import saved` names
    engine.saved, not the package); a subpackage (engine.kernels) is a module like the others."""
    trees = modules(package)
    subpackages = {n for n in trees if (ROOT / n.replace(".", "/") / "__init__.py").exists()}
    return {n: imported(n, t, n in subpackages, set(trees)) - {package} for n, t in trees.items() if n != package}


def test_the_circle_finder_finds_a_circle():
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
    tree = ast.parse("from .x import y\nfrom engine.z import w\ndef f():\n    from . import v\n    import engine.u.q\n")
    assert imported("engine.m", tree, False, {"engine.x", "engine.z", "engine.v", "engine.u", "engine.m"}) == \
        {"engine.x", "engine.z", "engine.v", "engine.u"}


def test_no_import_circle_inside_engine_or_app():
    for package in PACKAGES:
        found = circle(import_graph(package))
        assert found is None, f"{package}/ modules import each other in a circle: {' -> '.join(found)}"


def lengths(package: str) -> list[tuple[int, str, str]]:
    """(lines, kind, where) of every class and function in `package`, methods and nested functions included."""
    out = []
    for name, tree in modules(package).items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                out.append((node.end_lineno - node.lineno + 1, kind, f"{name}:{node.name} (line {node.lineno})"))
    return out


def test_no_class_over_250_lines_and_no_function_over_80():
    measured = [m for package in PACKAGES for m in lengths(package)]
    too_long = sorted([m for m in measured if m[1] == "class" and m[0] > LONGEST_CLASS]
                      + [m for m in measured if m[1] == "function" and m[0] > LONGEST_FUNCTION], reverse=True)
    assert not too_long, "too long (lines, kind, where): " + "; ".join(f"{n} {k} {w}" for n, k, w in too_long)
