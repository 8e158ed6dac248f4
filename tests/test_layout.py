"""The package's layout rules (docs/architecture.md), read from the source with ``ast``:
imports flow down the layers (server/'s parts down their own) and form no cycle between
folders and top-level modules, nor between files (imports inside functions counted: one may
defer a heavy import, never close a loop), ``engine/``
reaches no layer above it, ``runner/`` sees the engine only through its runner interface,
only the CLI's own modules import ``hlserve.cli``, no function is longer than
``MAX_FUNCTION_LINES`` and no module longer than ``MAX_MODULE_LINES``, every module opens with
a docstring, and the engine is one facade built in one place: nothing outside ``engine/``
reads it through ``getattr`` / ``hasattr``, nothing but ``engine/factory.py`` constructs an
``Engine``, and one function in the package is named ``build_engine``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "hlserve"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600
# the one place an Engine is constructed, and the one function of that name
ENGINE_FACTORY = "hlserve.engine.factory"
ENGINE_MODULE = "hlserve.engine.llm_engine"
# engine/ is below everything that drives it and above what it drives only through
# engine/batch.py's Runner interface, which runner/ and sim/ implement
ENGINE_MAY_NOT_IMPORT = ("runner", "sim", "server", "study", "bench", "driver", "cli", "llm",
                         "integrations")
RUNNER_SEES_OF_ENGINE = {"hlserve.engine.batch"}
# The one rule of the imports (docs/architecture.md): a module imports from its own folder or
# top-level module, or from a layer below its own; layers on one line are peers and do not
# import each other. runner/ and sim/ sit above engine/: they implement its Runner interface.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("hlserve",),  # the package root: re-exports the offline API
    ("cli",),
    ("html_report",),  # the HTML report of a sweep's, study's or bench's result
    ("bench",),
    ("server", "study", "integrations"),
    ("driver",),
    ("llm",),
    ("runner", "sim"),
    ("engine",),
    ("models", "tokenizer"),
    ("config", "cpu_runtime"),
    ("request",),
    ("structured",),  # grammars: below the request, whose params may carry one
    ("errors",),
)
# functions over the limit not yet split (each one a debt; the list only shrinks)
LONG_FUNCTION_EXCEPTIONS: set[str] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}
TREES: dict[str, ast.Module] = {m: ast.parse(p.read_text(encoding="utf-8"), str(p))
                                for m, p in MODULES.items()}


def is_package(mod: str) -> bool:
    return MODULES[mod].name == "__init__.py"


def resolve(mod: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The package's modules an import statement loads (lazy imports inside functions count:
    they are edges of the layout all the same)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = node.module or ""
    if node.level:  # relative: from the importing module's package
        pkg = mod.split(".") if is_package(mod) else mod.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join([*pkg, base] if base else pkg)
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in MODULES else base


def imports_of(mod: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(TREES[mod]):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found |= {t for t in resolve(mod, node) if t == "hlserve" or t.startswith("hlserve.")}
    return found


def unit(mod: str) -> str:
    """The layout's unit of a module: its folder under the package, or the top-level module."""
    parts = mod.split(".")
    return ".".join(parts[:2])


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod in MODULES:
        src = unit(mod)
        graph.setdefault(src, set())
        for target in imports_of(mod):
            if unit(target) not in (src, "hlserve"):  # the root re-exports; it is no layer
                graph[src].add(unit(target))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

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
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def edges_between(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """Each import edge inside a cycle, named by the modules that make it."""
    names = set(comp)
    return sorted(f"{mod} -> {t}" for mod in MODULES if unit(mod) in names
                  for t in imports_of(mod) if unit(t) in names and unit(t) != unit(mod))


def test_no_import_cycle_between_folders_and_top_level_modules() -> None:
    graph = unit_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        f"{' <-> '.join(c)}:\n    " + "\n    ".join(edges_between(graph, c)) for c in found)


def module_graph() -> dict[str, set[str]]:
    """Each module's imports of the package's other modules, those inside functions included:
    a function-level import may defer a heavy dependency (torch, matplotlib), but an edge it
    adds is an edge of the graph, so it cannot hide a loop between two files."""
    return {m: {t for t in imports_of(m) if t in MODULES and t != m} for m in MODULES}


def test_no_import_cycle_between_files() -> None:
    graph = module_graph()
    found = cycles(graph)
    assert not found, "import cycles between files:\n" + "\n".join(
        " <-> ".join(c) + ":\n    " + "\n    ".join(
            f"{m} -> {t}" for m in c for t in sorted(graph[m]) if t in c) for c in found)


def rank(u: str) -> int:
    name = u.removeprefix("hlserve.")
    ranks = [i for i, layer in enumerate(LAYERS) if name in layer]
    assert ranks, f"{u} is in no layer: add it to LAYERS and to docs/architecture.md"
    return ranks[0]


def test_imports_flow_downward() -> None:
    graph = unit_graph()
    bad = sorted(f"{mod} -> {t}" for mod in MODULES for t in imports_of(mod)
                 if unit(t) not in (unit(mod), "hlserve")
                 and rank(unit(t)) <= rank(unit(mod)))
    assert graph and not bad, "imports that do not flow downward (LAYERS):\n" + "\n".join(bad)


# server/ in parts (server/__init__.py): its sub-packages and top-level modules stack as the
# package's layers do, a part importing from itself or a line below, peers not at all
SERVER_LAYERS: tuple[tuple[str, ...], ...] = (
    ("app",),  # the app factory and serve
    ("routes",),  # the route table
    ("responses",),  # the Responses API, on the chat path
    ("openai_api",),  # chat and text completions: state, intake, generation, bodies, streams
    ("tools",),  # tool calls, reasoning, constraints
    ("protocol", "runtime"),  # the OpenAI wire format · the engine thread and the process
)


def server_part(mod: str) -> str | None:
    """A module's part of server/: its sub-package or top-level module (None outside it)."""
    parts = mod.split(".")
    return parts[2] if parts[:2] == ["hlserve", "server"] and len(parts) > 2 else None


def server_rank(part: str) -> int:
    ranks = [i for i, layer in enumerate(SERVER_LAYERS) if part in layer]
    assert ranks, f"server/{part} is in no layer: add it to SERVER_LAYERS and server/__init__.py"
    return ranks[0]


def test_server_parts_import_downward() -> None:
    for part in {server_part(m) for m in MODULES} - {None}:
        server_rank(part)  # every part has its place, imported or not
    pairs = [(mod, t, server_part(mod), server_part(t)) for mod in MODULES for t in imports_of(mod)]
    crossing = [(mod, t, a, b) for mod, t, a, b in pairs if a and b and a != b]
    bad = sorted(f"{mod} -> {t}" for mod, t, a, b in crossing if server_rank(b) <= server_rank(a))
    # the check sees what it checks: the state reaches the engine thread across parts
    assert ("hlserve.server.openai_api.state", "hlserve.server.runtime.bridge",
            "openai_api", "runtime") in crossing
    assert not bad, "server/ imports that do not flow downward (SERVER_LAYERS):\n" + "\n".join(bad)


def test_engine_imports_no_layer_above_it() -> None:
    banned = {f"hlserve.{name}" for name in ENGINE_MAY_NOT_IMPORT}
    bad = sorted(f"{mod} -> {t}" for mod in MODULES if unit(mod) == "hlserve.engine"
                 for t in imports_of(mod) if unit(t) in banned)
    assert not bad, "engine/ reaches upward:\n" + "\n".join(bad)


def test_runner_sees_the_engine_only_through_its_runner_interface() -> None:
    bad = sorted(f"{mod} -> {t}" for mod in MODULES if unit(mod) == "hlserve.runner"
                 for t in imports_of(mod)
                 if unit(t) == "hlserve.engine" and t not in RUNNER_SEES_OF_ENGINE)
    assert not bad, "runner/ imports engine internals:\n" + "\n".join(bad)


def is_cli_module(mod: str) -> bool:
    return mod == "hlserve.cli" or mod.startswith("hlserve.cli.")


def test_only_the_cli_imports_the_cli() -> None:
    bad = sorted(f"{mod} -> hlserve.cli" for mod in MODULES
                 if not is_cli_module(mod) and "hlserve.cli" in imports_of(mod))
    assert not bad, "modules outside the CLI import it:\n" + "\n".join(bad)


def long_functions() -> Iterator[tuple[str, int]]:
    for mod, tree in TREES.items():
        yield from _long_in(mod, tree.body, mod)


def _long_in(mod: str, body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, int]]:
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield from _long_in(mod, node.body, f"{prefix}.{node.name}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            n = (node.end_lineno or node.lineno) - first + 1
            if n > MAX_FUNCTION_LINES:
                yield f"{prefix}.{node.name}", n


def test_no_function_is_longer_than_the_limit() -> None:
    found = dict(long_functions())
    bad = sorted(f"{name} ({n} lines)" for name, n in found.items()
                 if name not in LONG_FUNCTION_EXCEPTIONS)
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(bad)
    stale = LONG_FUNCTION_EXCEPTIONS - set(found)
    assert not stale, f"exceptions no longer needed: {sorted(stale)}"


def long_modules(limit: int = MAX_MODULE_LINES) -> dict[str, int]:
    """Modules of more than ``limit`` lines, with their length."""
    lengths = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in MODULES.items()}
    return {m: n for m, n in lengths.items() if n > limit}


def test_no_module_is_longer_than_the_limit() -> None:
    bad = sorted(f"{m} ({n} lines)" for m, n in long_modules().items())
    assert not bad, f"modules over {MAX_MODULE_LINES} lines (split them):\n" + "\n".join(bad)


def dotted_names(node: ast.expr) -> list[str]:
    """The names an expression reaches through: ``self.engine.runner`` -> self, engine,
    runner; a call or subscript in the chain is looked through (``f(x).engine``)."""
    names: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            names.append(node.id)
            return names[::-1]
        else:
            return names[::-1]


def is_engine_name(name: str) -> bool:
    return name.lower().endswith("engine")


def getattr_on_engine(tree: ast.Module) -> Iterator[int]:
    """Lines of ``getattr`` / ``hasattr`` whose object is, or is reached through, something
    named ``engine`` (or ending in it: ``sim_engine``, ``self.engine.runner``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr") and node.args \
                and any(is_engine_name(n) for n in dotted_names(node.args[0])):
            yield node.lineno


def test_no_getattr_around_the_engine_outside_it() -> None:
    """The Engine offers what its callers read (stats, model_config, caps_report, ...):
    outside ``engine/`` nothing probes it or its parts by name."""
    bad = sorted(f"{mod}:{line}" for mod in MODULES if unit(mod) != "hlserve.engine"
                 for line in getattr_on_engine(TREES[mod]))
    assert not bad, "getattr/hasattr on the engine outside engine/:\n" + "\n".join(bad)


def engine_class_names(mod: str) -> tuple[set[str], set[str]]:
    """(names bound to the Engine class, names bound to its module) in ``mod``, however
    imported (``from ... import Engine as E``, ``import hlserve.engine.llm_engine as ee``)."""
    classes, modules = set(), set()
    if mod == ENGINE_MODULE:
        classes.add("Engine")
    for node in ast.walk(TREES[mod]):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                target = f"{node.module}.{alias.name}" if node.module else alias.name
                if node.module == ENGINE_MODULE and alias.name == "Engine":
                    classes.add(alias.asname or alias.name)
                elif target == ENGINE_MODULE:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == ENGINE_MODULE:
                    modules.add(alias.asname or alias.name)
    return classes, modules


def engine_constructions(mod: str) -> Iterator[int]:
    """Lines of calls that construct the Engine class in ``mod``."""
    classes, modules = engine_class_names(mod)
    for node in ast.walk(TREES[mod]):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Name) and f.id in classes) or (
                isinstance(f, ast.Attribute) and f.attr == "Engine"
                and ".".join(dotted_names(f.value)) in modules | {ENGINE_MODULE}):
            yield node.lineno


def test_only_the_factory_constructs_an_engine() -> None:
    bad = sorted(f"{mod}:{line}" for mod in MODULES if mod != ENGINE_FACTORY
                 for line in engine_constructions(mod))
    assert not bad, (f"Engine( outside {ENGINE_FACTORY} (build it with "
                     "build_engine(config, runner=...)):\n" + "\n".join(bad))
    assert list(engine_constructions(ENGINE_FACTORY)), "the factory constructs no Engine?"


def test_one_function_is_named_build_engine() -> None:
    found = sorted(f"{mod}:{node.lineno}" for mod, tree in TREES.items()
                   for node in ast.walk(tree)
                   if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                   and node.name == "build_engine")
    assert len(found) == 1 and found[0].startswith(f"{ENGINE_FACTORY}:"), (
        "build_engine must be one function, engine/factory.py's:\n" + "\n".join(found))


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_every_module_opens_with_a_docstring(mod: str) -> None:
    doc = ast.get_docstring(TREES[mod])
    assert doc and doc.strip(), f"{mod} does not open with a docstring saying what it is for"


def test_the_checks_see_what_they_check() -> None:
    """The rules above cannot pass by reading nothing: the walk finds the package's modules
    and the edges it is known to have."""
    assert {"hlserve.engine.llm_engine", "hlserve.runner.torch_runner", "hlserve.cli"} <= set(MODULES)
    assert "hlserve.engine.batch" in imports_of("hlserve.runner.torch_runner")
    assert "hlserve.engine.scheduler" in imports_of("hlserve.engine.llm_engine")
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # an import inside a function is an edge of the file graph (cmd_study imports lazily)
    assert "hlserve.study.study_report" in module_graph()["hlserve.cli.simulate"]


def same_named_modules(modules: set[str]) -> dict[str, list[str]]:
    """Module names used twice: two files of one stem, or a file named like a package
    (``engine/llm_engine.py`` under ``engine/``), anywhere in the package."""
    by_name: dict[str, list[str]] = {}
    for mod in modules:
        if mod != "hlserve":
            by_name.setdefault(mod.rsplit(".", 1)[-1], []).append(mod)
    return {name: sorted(mods) for name, mods in by_name.items() if len(mods) > 1}


def test_no_two_modules_share_a_name() -> None:
    """A name says one thing: ``errors`` or ``config`` twice sends a reader to the wrong file."""
    found = same_named_modules(set(MODULES))
    assert not found, "modules sharing a name:\n" + "\n".join(
        f"{name}: {', '.join(mods)}" for name, mods in sorted(found.items()))
    assert same_named_modules({"hlserve.a.errors", "hlserve.errors", "hlserve.b.c"}) == {
        "errors": ["hlserve.a.errors", "hlserve.errors"]}
