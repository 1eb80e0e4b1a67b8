"""The plan of the package: the forward → gradient registry is complete and symmetric, and
imports point down the layers (core → ops → cnn → ...) with no cycle."""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from pathlib import Path

import mpsnn as m
from mpsnn.core.binary import GradientKernel
from mpsnn.core.registry import forward_kernel_of, gradient_kernels_of, registered_pairs

ROOT = Path(m.__file__).resolve().parent

# Lower layers may be imported by higher ones, never the reverse.
LAYERS = [
    "errors", "core", "ops", "cnn", "optim", "graph", "nodes", "distributed", "models", "data",
    "io", "training", "cli",
]  # fmt: skip


def _public_classes() -> list[type]:
    return [v for v in vars(m).values() if inspect.isclass(v)]


def test_every_concrete_gradient_kernel_is_registered_both_ways() -> None:
    gradients = [
        c for c in _public_classes() if issubclass(c, GradientKernel) and c is not GradientKernel
    ]
    abstract = {m.ArithmeticGradient, m.PoolingGradient, m.UpsamplingGradient}
    for g in gradients:
        if g in abstract:
            assert forward_kernel_of(g) is None, f"{g.__name__} is a base, not registered"
            continue
        f = forward_kernel_of(g)
        assert f is not None, f"{g.__name__} names no forward kernel"
        assert g in gradient_kernels_of(f), f"{f.__name__} does not list {g.__name__}"
    for f, g in registered_pairs():
        assert forward_kernel_of(g) is f
        assert g._forward_class is f


def test_registry_answers_for_subclasses() -> None:
    class MyConvolution(m.Convolution):
        pass

    assert gradient_kernels_of(MyConvolution) == (m.ConvolutionGradient,)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(module: str, source: str) -> set[str]:
    """The mpsnn modules ``module`` imports anywhere in ``source``: at module level and inside
    functions, relative imports resolved, and, where it calls ``importlib.import_module`` or
    ``__import__``, every string constant that names a module below mpsnn (the bare word
    "mpsnn" is more often a distribution name than an import). ``from P import x``
    imports the module ``P.x`` when there is one, else ``P``."""
    is_package = MODULES.get(module, Path()).name == "__init__.py"
    tree = ast.parse(source)
    names: set[str] = set()
    dynamic = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, *([node.module] if node.module else [])])
            for a in node.names:
                names.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
        elif isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            dynamic = dynamic or called in ("import_module", "__import__")
    if dynamic:
        names.update(
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and "." in n.value
        )
    return {n for n in names if n in MODULES and n != module}


def _import_graph() -> dict[str, set[str]]:
    return {mod: _imports(mod, path.read_text()) for mod, path in MODULES.items()}


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:  # the package itself: the public surface, above everything
        return len(LAYERS)
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else len(LAYERS)


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules in order, the first repeated last), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = 2
        path.pop()
        return []

    for mod in sorted(graph):
        if mod not in state and (found := visit(mod)):
            return found
    return []


def test_the_import_parser_sees_every_kind_of_import() -> None:
    source = """
import mpsnn.core.device
from mpsnn.ops import triton
from . import window
from ..core import geometry


def f():
    from mpsnn.ops.optim_hyper import UpdateRule
    import importlib
    return importlib.import_module("mpsnn.graph.graph")
"""
    assert _imports("mpsnn.ops.optim", source) == {
        "mpsnn.core.device",
        "mpsnn.ops.triton",
        "mpsnn.ops.window",
        "mpsnn.core.geometry",
        "mpsnn.ops.optim_hyper",
        "mpsnn.graph.graph",
    }
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_point_down_the_layers() -> None:
    wrong = [
        f"{mod} imports {imp}"
        for mod, deps in _import_graph().items()
        for imp in deps
        if _layer(imp) > _layer(mod)
    ]
    assert not wrong, "imports pointing up: " + "; ".join(sorted(wrong))


def test_no_import_cycles_between_modules() -> None:
    """Function-level (lazy) imports count: a cycle that only a deferred import closes is
    still a cycle of dependencies, and a package's ``__init__`` importing one of its modules
    is an edge like any other."""
    cycle = _cycle(_import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def _bound_names(path: Path) -> tuple[set[str], set[str]]:
    """The names ``path`` binds at module level by a ``class`` statement, and by assignment."""
    classes, assigned = set(), set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            classes.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            assigned.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return classes, assigned


def test_gradient_and_neuron_node_classes_are_class_statements() -> None:
    """Every gradient node and neuron node class of the node families is written out where it
    is defined, so that a search for ``class ConvolutionGradientNode`` finds it."""
    import sys

    import mpsnn.nodes as families
    from mpsnn.graph.nodes import GradientFilterNode
    from mpsnn.nodes.neuron import NeuronNode

    nodes = [
        c
        for c in (getattr(families, name) for name in families.__all__)
        if inspect.isclass(c) and issubclass(c, GradientFilterNode | NeuronNode)
    ]
    assert len(nodes) > 30
    missing = [
        f"{c.__module__}.{c.__name__}"
        for c in nodes
        if c.__name__ not in _bound_names(Path(sys.modules[c.__module__].__file__))[0]
    ]
    assert not missing, "not written as class statements: " + ", ".join(missing)


def test_no_module_makes_names_through_globals() -> None:
    found = [
        f"{mod} line {node.lineno}"
        for mod, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "globals"
    ]
    assert not found, "globals() used: " + "; ".join(found)


def test_every_public_class_is_bound_by_name_in_its_module() -> None:
    """A public class is a ``class`` statement or a ``Name = ...`` assignment of its module:
    never made in a loop and stored where a search for its name cannot find it."""
    import sys

    hidden = []
    for c in _public_classes():
        path = Path(sys.modules[c.__module__].__file__)
        classes, assigned = _bound_names(path)
        if c.__name__ not in classes | assigned:
            hidden.append(f"{c.__module__}.{c.__name__}")
    assert not hidden, "classes bound by no statement of their module: " + ", ".join(hidden)


# the library's layers, whose modules other modules import names from
LIBRARY = ("core", "ops", "cnn", "optim", "graph", "nodes")


def test_no_module_only_re_exports() -> None:
    """A module that only imports names and lists them in ``__all__`` is a forwarding address:
    importers name the module that defines what they use. Package ``__init__`` files are the
    public faces and may."""
    shims = []
    for mod, path in MODULES.items():
        body = ast.parse(path.read_text()).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        statements = [s for s in body if not isinstance(s, ast.Import | ast.ImportFrom)]
        only_all = all(
            isinstance(s, ast.Assign) and [ast.unparse(t) for t in s.targets] == ["__all__"]
            for s in statements
        )
        if path.name != "__init__.py" and body and only_all:
            shims.append(mod)
    assert not shims, "modules that only re-export: " + ", ".join(sorted(shims))


def _all_names(tree: ast.Module) -> list[str]:
    """The names a module's top-level ``__all__ = [...]`` (or ``__all__: ... = [...]``) lists."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, ast.Assign | ast.AnnAssign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in targets
        ):
            return list(ast.literal_eval(node.value)) if node.value is not None else []
    return []


def _defined_names(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level (also under a top-level ``if``/``try``):
    ``def``, ``class`` and assignment targets (an enum, a type alias), never imports."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                found.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))

    visit(tree.body)
    return found


def test_no_module_re_exports_names_of_another() -> None:
    """Outside the package ``__init__`` files (the public faces), a module's ``__all__`` lists
    only what it defines, and it marks no imported name for export (``import X as X``): a name
    has one home, and importers name it."""
    found = []
    for mod, path in sorted(MODULES.items()):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        defined = _defined_names(tree)
        found += [
            f"{mod} lists {name} in __all__" for name in _all_names(tree) if name not in defined
        ]
        found += [
            f"{mod} marks {a.name} from {node.module} for export"
            for node in tree.body
            if isinstance(node, ast.ImportFrom)
            for a in node.names
            if a.asname == a.name
        ]
    assert not found, "re-exported names: " + "; ".join(found)


def test_names_are_imported_from_the_module_that_defines_them() -> None:
    """Inside mpsnn, a name taken from a library module (not a package ``__init__``) is one
    that module defines, not one it imports: a moved name is imported from its new home."""
    defined = {
        mod: set().union(*_bound_names(path)) | {
            n.name for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        for mod, path in MODULES.items()
    }  # fmt: skip
    wrong = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module not in MODULES:
                continue
            source = node.module
            parts = source.split(".")
            if MODULES[source].name == "__init__.py" or len(parts) < 2 or parts[1] not in LIBRARY:
                continue
            wrong += [
                f"{mod} takes {a.name} from {source}"
                for a in node.names
                if a.name != "*"
                and a.name not in defined[source]
                and f"{source}.{a.name}" not in MODULES  # a submodule
            ]
    assert not wrong, "names imported from a module that does not define them: " + "; ".join(
        sorted(wrong)
    )


# Words that narrate how the code came to be rather than why it is so.
_HISTORY = re.compile(
    r"\b(measured|first choice|earlier versions?|used to be|previously|before this change|"
    r"sessions?|no longer a)\b",
    re.IGNORECASE,
)


def test_comments_and_docstrings_say_why_not_history() -> None:
    """Comments and docstrings of the library's layers state facts and reasons; a measurement
    that justifies a choice is stated as a fact. Quoted text (MPS's own words) is exempt."""
    found = []
    for mod, path in MODULES.items():
        if mod.split(".")[1:2] and mod.split(".")[1] not in LIBRARY:
            continue
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type not in (tokenize.COMMENT, tokenize.STRING):
                continue
            text = re.sub(r'"[^"]*"', "", tok.string.strip("\"'"))  # quotations
            if m := _HISTORY.search(text):
                found.append(f"{mod} line {tok.start[0]}: {m.group(0)!r}")
    assert not found, "history in comments or docstrings: " + "; ".join(found)
