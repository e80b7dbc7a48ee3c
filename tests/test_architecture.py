"""Structure checks a reviewer would otherwise do by hand: the package's import graph has no cycles."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "keras_lms"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    """keras_lms module -> the keras_lms modules it imports anywhere (top level or inside functions)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def find_cycle(graph: dict):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def test_no_import_cycles_between_modules():
    # A package's __init__ re-exporting its submodules is not a cycle of concerns: only module -> module edges.
    graph = {name: {d for d in deps if not _is_package(d)} for name, deps in import_graph().items()
             if not _is_package(name)}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_cycle_finder_finds_a_cycle():
    """Negative control: the checker reports a planted cycle (planner -> policy -> planner, as in 0.1.0)."""
    graph = import_graph()
    graph["keras_lms.policy"] = set(graph["keras_lms.policy"]) | {"keras_lms.planner"}
    assert "keras_lms.planner" in graph["keras_lms.policy"] and "keras_lms.policy" in graph["keras_lms.planner"]
    assert find_cycle({k: v for k, v in graph.items() if not _is_package(k)}) is not None


def test_layer_facts_are_defined_once():
    """The table of what layer gradients read lives in keras_lms/layer_facts.py only."""
    for path in PACKAGE.rglob("*.py"):
        if path.name == "layer_facts.py":
            continue
        text = path.read_text()
        assert '"GlobalAveragePooling1D", "GlobalAveragePooling2D"' not in text, path  # the structural table
        assert "not unit.max_value and not unit.negative_slope" not in text, path
