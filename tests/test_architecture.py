"""The house rules of the package, read from its source: layers, seams, run paths, sizes.

Each rule lists every offending `file:line` so that a failure says where to look. The rules are
read with `ast`, so docstrings, comments and error messages never count as code.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / "kit"

# Layers, lowest first. A module may import from its own layer or any layer below it.
GROUND = (
    "kit",
    "kit.errors",
    "kit.io",
    "kit.logs",
    "kit.config",
    "kit.config.sections",
    "kit.config.model",
    "kit.config.preservation",
    "kit.config.sources",
    "kit.optim",
    "kit.precision",
)
LAYERS: list[tuple[str, ...]] = [
    GROUND,
    ("kit.run",),
    ("kit.families",),
    ("kit.data", "kit.methods"),
    ("kit.sample",),
    ("kit.report",),
    ("kit.train",),
    ("kit.export", "kit.preflight", "kit.toy"),
    ("kit.ui",),
    ("kit.cli", "kit.cli_share", "kit.cli_data"),
    # `python -m kit` runs the command line, so the entry point sits above it.
    ("kit.__main__",),
]
SUBPACKAGES = [
    p
    for layer in LAYERS[1:]
    for p in layer
    if p not in ("kit.cli", "kit.cli_share", "kit.cli_data", "kit.__main__")
]

MAX_LINES = 600

# The seams: only these folders may know a family or a method by its name.
SEAM_FOLDERS = ("kit/families/", "kit/methods/")

# Names that make up the run folder's layout; only RunDir joins them to a path.
RUN_PATH_NAMES = {
    "checkpoints",
    "validation",
    "logs",
    "exports",
    "metrics.jsonl",
    "doctor.json",
    "archive.json",
    "config.json",
}
RUN_FOLDER_MODULE = "kit/run/folder.py"
# (file, literal): the same names where they are not a run folder's, and why.
RUN_PATH_ALLOWED = {
    # A diffusers model folder keeps each part's `config.json`: a base model, not a run.
    ("kit/families/identity.py", "config.json"),
}


# ------------------------------------------------------------------ reading the source


@dataclasses.dataclass
class Source:
    rel: str
    """Path from the repository root, with forward slashes."""
    module: str
    tree: ast.Module
    lines: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def sources() -> tuple[Source, ...]:
    """Every module of the package, parsed once per test session."""
    out = []
    for path in sorted(KIT.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        out.append(
            Source(
                path.relative_to(ROOT).as_posix(),
                _module_name(path),
                tree,
                len(text.splitlines()),
            )
        )
    return tuple(out)


@functools.cache
def module_names() -> frozenset[str]:
    return frozenset(s.module for s in sources())


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def walk(node: ast.AST, in_function: bool = False, type_checking: bool = False):
    """Every node below `node`, with whether it runs only when a function is called, and
    whether it sits in the body of `if TYPE_CHECKING:` (never run)."""
    guarded = isinstance(node, ast.If) and _is_type_checking(node.test)
    for child in ast.iter_child_nodes(node):
        # Only the body of `if TYPE_CHECKING:` is skipped at run time, not its `else`.
        tc = type_checking or (guarded and child in node.body)
        yield child, in_function, tc
        yield from walk(child, in_function or isinstance(child, FUNCTIONS), tc)


@dataclasses.dataclass
class Import:
    line: int
    target: str
    """The kit module imported (the deepest one that exists)."""
    names: tuple[str, ...]
    """For `from m import a, b`: a and b."""
    in_function: bool
    type_checking: bool


def _resolve(src: Source, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = src.module.split(".")
    if not src.rel.endswith("__init__.py"):
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _kit_module(name: str) -> str:
    """The deepest existing kit module of a dotted name (`kit.a.b.func` → `kit.a.b`)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in module_names():
        parts.pop()
    return ".".join(parts)


@functools.cache
def imports(rel: str) -> tuple[Import, ...]:
    """Every import of a kit module in one file, with where it sits."""
    src = next(s for s in sources() if s.rel == rel)
    out = []
    for node, *flags in walk(src.tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "kit" or alias.name.startswith("kit."):
                    out.append(Import(node.lineno, _kit_module(alias.name), (), *flags))
            continue
        base = _resolve(src, node)
        if not (base == "kit" or base.startswith("kit.")):
            continue
        names = tuple(a.name for a in node.names)
        # `from kit.run import checkpoint` imports the module kit.run.checkpoint.
        targets = {_kit_module(f"{base}.{n}") for n in names} or {_kit_module(base)}
        for target in sorted(targets):
            out.append(Import(node.lineno, target, names, *flags))
    return tuple(out)


def layer_of(module: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        for name in layer:
            if module == name or (name not in GROUND and module.startswith(name + ".")):
                return i
    return None


def _report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what}:\n" + "\n".join(sorted(problems))


# ------------------------------------------------------------------ (g) the folders


def test_every_stage_folder_exists():
    missing = [p for p in SUBPACKAGES if not (ROOT / p.replace(".", "/") / "__init__.py").is_file()]
    missing += [
        g
        for g in GROUND[1:] + ("kit.cli", "kit.cli_share", "kit.cli_data")
        if not (ROOT / f"{g.replace('.', '/')}.py").is_file()
        and not (ROOT / g.replace(".", "/") / "__init__.py").is_file()
    ]
    assert not missing, _report(missing, "stage modules or folders missing")


def test_every_module_has_a_layer():
    unplaced = [f"{s.rel}:1 {s.module}" for s in sources() if layer_of(s.module) is None]
    assert not unplaced, _report(unplaced, "modules in no layer (add them to LAYERS)")


# ------------------------------------------------------------------ (a) layers and cycles


def test_imports_point_down_the_layers():
    problems = []
    for src in sources():
        mine = layer_of(src.module)
        if mine is None:
            continue
        for imp in imports(src.rel):
            theirs = layer_of(imp.target)
            if theirs is not None and theirs > mine:
                problems.append(
                    f"{src.rel}:{imp.line} {src.module} (layer {mine}) imports "
                    f"{imp.target} (layer {theirs})"
                )
    assert not problems, _report(problems, "imports that point up the layers")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for src in sources():
        graph.setdefault(src.module, set())
        for imp in imports(src.rel):
            # What runs when the module is imported: not function bodies, not type-only imports.
            if imp.in_function or imp.type_checking or imp.target == src.module:
                continue
            graph[src.module].add(imp.target)
            where.setdefault((src.module, imp.target), f"{src.rel}:{imp.line}")
    problems = []
    for comp in _cycles(graph):
        inside = set(comp)
        edges = [
            f"{where[(a, b)]} {a} -> {b}" for a in comp for b in sorted(graph[a]) if b in inside
        ]
        problems.append(f"cycle among {', '.join(comp)}:\n    " + "\n    ".join(edges))
    assert not problems, _report(problems, "import cycles")


# ------------------------------------------------------------------ (b) no hidden kit imports


def test_no_kit_import_inside_a_function():
    problems = []
    for src in sources():
        # The command line imports lazily so that `kit --help` is fast.
        if src.rel in ("kit/cli.py", "kit/cli_share.py", "kit/cli_data.py"):
            continue
        for imp in imports(src.rel):
            if imp.in_function:
                problems.append(f"{src.rel}:{imp.line} imports {imp.target} inside a function")
        for node, in_function, _ in walk(src.tree):
            # importlib.import_module("kit.x") / __import__("kit.x") with a literal name.
            if (
                isinstance(node, ast.Call)
                and _call_name(node.func) in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("kit")
                and in_function
            ):
                problems.append(f"{src.rel}:{node.lineno} imports {node.args[0].value} lazily")
    assert not problems, _report(problems, "kit imports inside functions (move them to the top)")


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


# ------------------------------------------------------------------ (c) no names outside seams


@functools.cache
def seam_names() -> tuple[frozenset[str], frozenset[str]]:
    """The registered family names, and every method name (config's choices and registry)."""
    import kit.config
    import kit.families
    import kit.methods

    families = frozenset(kit.families.family_names())
    methods = {"dora"}
    for cls in vars(kit.config).values():
        if dataclasses.is_dataclass(cls) and isinstance(cls, type):
            hint = typing.get_type_hints(cls).get("network_type")
            methods.update(typing.get_args(hint) if hint is not None else ())
    if hasattr(kit.methods, "method_names"):
        methods.update(kit.methods.method_names())
    assert families and len(methods) > 1, (families, methods)
    return families, frozenset(methods)


def _names_in(node: ast.AST) -> list[str]:
    """The string constants of a literal or of a tuple / list / set of literals."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for elt in node.elts for v in _names_in(elt)]
    return []


def _attr_or_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


# Fields whose value is a method name: comparing them to anything is a branch on the method.
# (`model_family` is compared with another config's in places, which names no family, so it
# counts only against a literal name, like any other value.)
SEAM_FIELDS = ("network_type",)
SEAM_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _seam_uses(src: Source, names: frozenset[str]) -> list[str]:
    found = []
    for node in ast.walk(src.tree):
        hits: list[str] = []
        if isinstance(node, ast.Compare) and any(isinstance(op, SEAM_OPS) for op in node.ops):
            operands = [node.left, *node.comparators]
            hits = [f"compares with '{v}'" for o in operands for v in _names_in(o) if v in names]
            hits += [
                f"compares {_attr_or_name(o)}" for o in operands if _attr_or_name(o) in SEAM_FIELDS
            ]
        elif isinstance(node, ast.Dict):
            hits = [
                f"table keyed by '{k.value}'"
                for k in node.keys
                if isinstance(k, ast.Constant) and k.value in names
            ]
        elif isinstance(node, ast.Call) and _call_name(node.func) == "dict":
            hits = [f"table keyed by '{k.arg}'" for k in node.keywords if k.arg in names]
        elif isinstance(node, ast.Subscript) and _attr_or_name(node.value) != "Literal":
            hits = [f"looks up '{v}'" for v in _names_in(node.slice) if v in names]
        elif isinstance(node, ast.MatchValue):
            hits = [f"matches '{v}'" for v in _names_in(node.value) if v in names]
        elif isinstance(node, ast.Match) and _attr_or_name(node.subject) in SEAM_FIELDS:
            hits = [f"matches on {_attr_or_name(node.subject)}"]
        found += [f"{src.rel}:{node.lineno} {h}" for h in hits]
    return found


def test_no_family_or_method_name_outside_the_seams():
    families, methods = seam_names()
    names = families | methods
    problems = []
    for src in sources():
        if src.rel.startswith(SEAM_FOLDERS):
            continue
        problems += _seam_uses(src, names)
    assert not problems, _report(
        problems, "branches on a family or method name outside kit/families/ and kit/methods/"
    )


def test_the_import_rules_see_functions_and_type_checking():
    code = """
import kit.io
if TYPE_CHECKING:
    import kit.config
else:
    import kit.logs
def f():
    import kit.errors
class C:
    import kit.optim
"""
    seen = {
        n.names[0].name: (f, t) for n, f, t in walk(ast.parse(code)) if isinstance(n, ast.Import)
    }
    assert seen == {
        "kit.io": (False, False),
        "kit.config": (False, True),
        "kit.logs": (False, False),
        "kit.errors": (True, False),
        "kit.optim": (False, False),
    }


def test_the_seam_rule_catches_what_it_should():
    """The name rule itself: these count, docstrings, messages and defaults do not."""
    code = '''
"""Trains sd15 and lora."""
DEFAULT: str = "sd15"
def f(cfg, kind):
    """For lora."""
    if cfg.model.model_family == "sdxl": pass
    if kind in ("lora", "dora"): pass
    if cfg.network.network_type == other: pass
    table = {"flux": 1}
    x = TABLE["wan"]
    match kind:
        case "full": pass
    raise ValueError("network_type lora is not for sd15")
'''
    tree = ast.parse(code)
    src = Source("x.py", "x", tree, 0)
    found = _seam_uses(src, frozenset({"sd15", "sdxl", "flux", "wan", "lora", "dora", "full"}))
    lines = sorted({int(f.split(":")[1].split()[0]) for f in found})
    assert lines == [6, 7, 8, 9, 10, 12], found


# ------------------------------------------------------------------ (d) run paths from RunDir


def _path_parts(value: str) -> set[str]:
    return {p for p in value.replace("\\", "/").split("/") if p}


def _path_literals(node: ast.AST) -> list[ast.Constant]:
    """String literals that a path is built from at this node."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        operands = [node.left, node.right]
    elif isinstance(node, ast.Call) and _call_name(node.func) in ("joinpath", "Path", "join"):
        operands = list(node.args)
    elif isinstance(node, ast.JoinedStr):
        # f"{run}/checkpoints/..." spells a path in a string.
        operands = [v for v in node.values if isinstance(v, ast.Constant) and "/" in v.value]
    else:
        return []
    return [o for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)]


def test_the_run_path_rule_catches_what_it_should():
    code = """
\"\"\"Writes checkpoints/ and logs/metrics.jsonl.\"\"\"
a = root / "checkpoints" / name
b = Path(root, "logs")
c = root.joinpath("exports", "kohya")
d = f"{root}/validation/step-1"
e = root / "logs/metrics.jsonl"
print("no checkpoints yet")
f = {"checkpoints": 3}
"""
    lines = sorted({lit.lineno for n in ast.walk(ast.parse(code)) for lit in _path_literals(n)})
    assert lines == [3, 4, 5, 6, 7]


def test_run_paths_only_from_rundir():
    problems = []
    for src in sources():
        if src.rel == RUN_FOLDER_MODULE:
            continue
        for node in ast.walk(src.tree):
            for lit in _path_literals(node):
                for name in sorted(_path_parts(lit.value) & RUN_PATH_NAMES):
                    if (src.rel, name) not in RUN_PATH_ALLOWED:
                        problems.append(f"{src.rel}:{lit.lineno} joins '{name}' to a path")
    assert not problems, _report(
        problems, "run-folder paths built outside RunDir (kit/run/folder.py)"
    )


# ------------------------------------------------------------------ (e) module size


def test_no_module_over_the_size_limit():
    big = [f"{s.rel}:{MAX_LINES + 1} has {s.lines} lines" for s in sources() if s.lines > MAX_LINES]
    assert not big, _report(big, f"modules over {MAX_LINES} lines")


# ------------------------------------------------------------------ (f) private names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_name_used_across_modules():
    problems = []
    for src in sources():
        module_aliases: dict[str, str] = {}
        for node in ast.walk(src.tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(src, node)
                if not (base == "kit" or base.startswith("kit.")) or base == src.module:
                    continue
                for alias in node.names:
                    if _private(alias.name):
                        problems.append(f"{src.rel}:{node.lineno} imports {base}.{alias.name}")
                    elif f"{base}.{alias.name}" in module_names():
                        module_aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("kit.") and alias.asname:
                        module_aliases[alias.asname] = alias.name
        for node in ast.walk(src.tree):
            # `ckpt._helper` where ckpt is another kit module.
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases
                and module_aliases[node.value.id] != src.module
            ):
                problems.append(
                    f"{src.rel}:{node.lineno} uses {module_aliases[node.value.id]}.{node.attr}"
                )
    assert not problems, _report(problems, "private names used across modules")


@pytest.mark.parametrize(
    "rel", ["kit/cli.py", "kit/cli_share.py", "kit/cli_data.py", "kit/run/folder.py"]
)
def test_the_rules_read_the_files_they_name(rel):
    """A renamed file would silently drop out of a rule's exception; keep the names true."""
    assert any(s.rel == rel for s in sources())
    for allowed, _ in RUN_PATH_ALLOWED:
        assert (ROOT / allowed).is_file(), allowed
