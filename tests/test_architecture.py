"""Structure checks a reviewer would otherwise do by hand: the package's import graph has no cycles, planning
imports no back end, nothing outside the back ends branches on a back end's name, and no module is over 400 lines."""

import ast
import pathlib
import re

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
    """Negative control: the checker reports a planted cycle (budget -> rules -> budget, as planner -> policy ->
    planner was in 0.1.0)."""
    graph = import_graph()
    graph["keras_lms.planning.rules"] = set(graph["keras_lms.planning.rules"]) | {"keras_lms.planning.budget"}
    assert "keras_lms.planning.rules" in graph["keras_lms.planning.budget"]
    assert find_cycle({k: v for k, v in graph.items() if not _is_package(k)}) is not None


def reachable(graph: dict, start: str) -> set:
    """Every keras_lms module `start` imports, directly or through others (sub-packages' __init__ included; not
    the root `keras_lms`, which `from keras_lms import x` names but which is the public face, not a dependency)."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen and dep != "keras_lms":
                seen.add(dep)
                todo.append(dep)
    return seen


def _planning_reaches_offload(graph: dict) -> dict:
    planning = [name for name in graph if name == "keras_lms.planning" or name.startswith("keras_lms.planning.")]
    return {name: sorted(d for d in reachable(graph, name) if d.startswith("keras_lms.offload"))
            for name in planning if any(d.startswith("keras_lms.offload") for d in reachable(graph, name))}


def test_planning_imports_no_back_end():
    """keras_lms.planning gets the back end passed in (`plan_step(backend, ...)`) and its facts from it: none of
    its modules imports keras_lms.offload, directly or through another module, nor TensorFlow or torch."""
    graph = import_graph()
    assert len([n for n in graph if n.startswith("keras_lms.planning.")]) >= 7
    assert _planning_reaches_offload(graph) == {}
    for path in (PACKAGE / "planning").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("tensorflow", "torch") for n in names), (path, names)


def test_planning_import_check_finds_a_planted_import():
    """Negative control: a planted import of the TensorFlow back end from the memory model is found."""
    graph = import_graph()
    graph["keras_lms.planning.memory_model"] = set(graph["keras_lms.planning.memory_model"]) | {
        "keras_lms.offload.tensorflow.step_memory"}
    assert "keras_lms.planning.memory_model" in _planning_reaches_offload(graph)
    assert "keras_lms.planning.budget" in _planning_reaches_offload(graph)  # and through it, the budget planner


BACKEND_NAMES = ("tensorflow", "torch", "jax")
# Outside keras_lms/offload/ only these may compare with a back end's name: the adapter's passing over trained
# batches, which reads Keras' private train function, whose input differs per Keras back end, and
# keras_lms.horovod's import-time refusal of a back end other than TensorFlow.
BACKEND_BRANCH_ALLOWED = ("offload/", "_keras_adapter/training.py", "horovod/_hvd.py")


def backend_name_branches(source: str) -> list:
    """Line numbers of comparisons with a back end's name (`== "torch"`, `in ("tensorflow", ...)`, ...)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for operand in [node.left, *node.comparators]:
            values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            if any(isinstance(v, ast.Constant) and v.value in BACKEND_NAMES for v in values):
                lines.append(node.lineno)
    return lines


def test_no_backend_name_branch_outside_the_back_ends():
    """What differs between back ends is behind the back-end contract (`keras_lms.offload.Backend`, including
    `memory_facts()`): planning, the report, the model and the callbacks never ask which back end runs."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(BACKEND_BRANCH_ALLOWED):
            continue
        lines = backend_name_branches(path.read_text())
        if lines:
            found[relative] = lines
    assert found == {}, found


def test_backend_name_branch_check_finds_one():
    """Negative control: the branch the memory model had before the back-end facts (`if backend == "torch"`)."""
    assert backend_name_branches('if backend == "torch":\n    pass\n') == [1]
    assert backend_name_branches('ok = keras.backend.backend() in ("tensorflow", "torch")\n') == [1]
    assert backend_name_branches('name = "torch"\n') == []


def test_no_module_is_over_400_lines():
    """Small modules with one job (docs/design.md's file map lists them)."""
    long = {p.relative_to(PACKAGE).as_posix(): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}, long


def test_layer_facts_are_defined_once():
    """The table of what layer gradients read lives in keras_lms/planning/layer_facts.py only."""
    for path in PACKAGE.rglob("*.py"):
        if path.name == "layer_facts.py":
            continue
        text = path.read_text()
        assert '"GlobalAveragePooling1D", "GlobalAveragePooling2D"' not in text, path  # the structural table
        assert "not unit.max_value and not unit.negative_slope" not in text, path


def design_file_map(text: str) -> set:
    """The module paths (relative to keras_lms/) listed in docs/design.md's "Data path" file map."""
    start = text.index("```\nkeras_lms/")
    block = text[start:text.index("```", start + 4)].splitlines()[2:]
    listed, stack = set(), []
    for line in block:
        match = re.match(r"^( +)(\S+)", line)
        if not match or not match.group(2).endswith((".py", "/")):
            continue
        indent, name = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        listed.add("".join(part for _, part in stack) + name)
        if name.endswith("/"):
            stack.append((indent, name))
    return listed


def test_the_design_file_map_matches_the_tree():
    """docs/design.md lists every module of the package (but package __init__s) and no module that is gone."""
    listed = design_file_map((PACKAGE.parent / "docs" / "design.md").read_text())
    tree = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    assert sorted(t for t in tree if t not in listed and not t.endswith("__init__.py")) == []
    assert sorted(m for m in listed if m.endswith(".py") and m not in tree) == []


def test_the_file_map_check_sees_a_missing_module():
    """Negative control: a map without planning/step.py, and one with a module that is gone."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    assert "planning/step.py" in design_file_map(text)
    assert "planning/step.py" not in design_file_map(text.replace("    step.py          plan_step", "    x"))
    assert "planner.py" in design_file_map(text.replace("  config.py ", "  planner.py x\n  config.py "))
