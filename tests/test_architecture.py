"""docs/architecture.md's module table and dependency rules, checked against the code.

The table has one row per module: `| `path` | one concept | imports from kvconnect |`, the
imports written as dotted paths below `kvconnect` (`stream.wire`, `events`), plus `vLLM` for
a module that imports vLLM itself, or `nothing`. A module added, moved or rewired without
its row fails here, so the map cannot drift from the code.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvconnect"
DOC = ROOT / "docs" / "architecture.md"

VOCABULARY = {"config", "hashing", "events", "messages", "transfer_params"}
MODEL_TORCH_FREE = {"model.source", "model.file_digest", "model.gguf_file", "model.tokenizer"}
"""What `--model` names, its file and its tokenizer: the part of `model/` the router imports."""
BASE = VOCABULARY | MODEL_TORCH_FREE
"""Modules that import nothing from the package but each other."""
ENGINE_MAY_IMPORT_FROM_CONNECTOR = {
    "connector",  # the package itself re-exports base and registry only
    "connector.base",
    "connector.registry",
    "connector.step",
    "connector.aggregator",
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts) or "__init__"


def is_module(name: str) -> bool:
    base = PACKAGE.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def imports_of(path: Path) -> set[str]:
    """kvconnect modules `path` imports anywhere in it (lazy imports too), and "vLLM"."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module.startswith("kvconnect"):
                names = [
                    f"{node.module}.{a.name}"
                    if is_module(f"{node.module}.{a.name}".removeprefix("kvconnect."))
                    else node.module
                    for a in node.names
                ]
        for name in names:
            if name == "vllm" or name.startswith("vllm."):
                found.add("vLLM")
            elif name == "kvconnect":
                found.add("__init__")
            elif name.startswith("kvconnect."):
                found.add(name.removeprefix("kvconnect."))
    own = module_name(path)
    found.discard(own)
    return found


@functools.cache  # read-only: parsed once for every test here
def code_modules() -> dict[str, set[str]]:
    """Every module with more than a docstring, by name, with its imports."""
    result = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        body = [
            n
            for n in tree.body
            if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        ]
        if body:
            result[module_name(path)] = imports_of(path)
    return result


ROW = re.compile(r"^\| `([^`]+)` \| (.+?) \| (.+?) \|$")


def doc_rows() -> dict[str, set[str]]:
    rows: dict[str, set[str]] = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m is None:
            continue
        path, _, imports = m.groups()
        name = module_name(PACKAGE / path)
        assert name not in rows, f"docs/architecture.md: two rows for {path}"
        rows[name] = set() if imports == "nothing" else {i.strip() for i in imports.split(",")}
    return rows


def test_every_module_has_one_row_and_its_imports_are_the_codes() -> None:
    code, doc = code_modules(), doc_rows()
    assert sorted(set(code) - set(doc)) == [], "modules without a row in docs/architecture.md"
    assert sorted(set(doc) - set(code)) == [], "rows in docs/architecture.md for no module"
    wrong = {
        name: (sorted(doc[name]), sorted(code[name])) for name in code if doc[name] != code[name]
    }
    assert wrong == {}, "rows whose imports differ: name: (doc, code)"


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of what `path` imports from outside kvconnect (lazy imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    found.discard("kvconnect")
    return found


def test_vocabulary_and_the_models_torch_free_half_import_only_each_other() -> None:
    code = code_modules()
    for name in BASE:
        assert code[name] <= BASE, (name, code[name])
    assert "model" not in code, "model/__init__.py must stay a docstring: the router imports model/"


def test_engine_knows_connectors_through_four_modules() -> None:
    for name, imports in code_modules().items():
        if name.startswith("engine."):
            connector = {i for i in imports if i.split(".")[0] == "connector"}
            assert connector <= ENGINE_MAY_IMPORT_FROM_CONNECTOR, (name, connector)


def test_only_the_vllm_package_imports_vllm() -> None:
    for name, imports in code_modules().items():
        assert "vLLM" not in imports or name.startswith("vllm."), name


def test_router_imports_the_vocabulary_stream_api_and_http_only() -> None:
    allowed_roots = {"router", "stream", "api", "http", "__init__"}  # the root: its version
    for name, imports in code_modules().items():
        if name.startswith("router."):
            outside = {i for i in imports if i not in BASE and i.split(".")[0] not in allowed_roots}
            assert outside == set(), (name, outside)


def test_api_is_the_protocol_only() -> None:
    for name, imports in code_modules().items():
        if name.startswith("api."):
            outside = {i for i in imports if i.split(".")[0] != "api" and i not in VOCABULARY}
            assert outside == set(), (name, outside)


def test_http_imports_only_itself_and_the_protocols_error_body() -> None:
    for name, imports in code_modules().items():
        if name.startswith("http."):
            outside = {i for i in imports if i.split(".")[0] != "http"}
            assert outside <= {"api.protocol"}, (name, outside)


def test_what_the_router_imports_imports_no_torch() -> None:
    roots = ("api.", "http.", "router.")
    checked = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name.startswith(roots) or name in BASE:
            assert "torch" not in third_party_imports(path), name
            checked += 1
    assert checked >= len(BASE) + 3


def test_the_subscriber_never_imports_the_publisher() -> None:
    code = code_modules()
    assert not code["stream.subscriber"] & {"stream.publisher", "stream.replay"}


def test_only_commands_start_servers_from_flags() -> None:
    for name, imports in code_modules().items():
        if not (name == "cli" or name.startswith("commands")):
            assert not {i for i in imports if i.split(".")[0] == "commands"}, name


def test_offload_halves_share_only_messages() -> None:
    code = code_modules()
    assert "connector.offload.worker" not in code["connector.offload.scheduler"]
    assert "connector.offload.scheduler" not in code["connector.offload.worker"]


def test_no_import_cycle() -> None:
    code = code_modules()
    graph = {n: {i for i in imps if i in code} for n, imps in code.items()}
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            pytest.fail(f"import cycle: {' -> '.join([*path, n])}")
        state[n] = 1
        for m in sorted(graph[n]):
            # a package's own __init__ importing its children is not a cycle back up
            if not m.startswith(n + ".") and not (n.startswith(m + ".") and m != "__init__"):
                visit(m, [*path, n])
        state[n] = 2

    for n in sorted(graph):
        visit(n, [])


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((f"{module_name(path)}.{node.name}:{node.lineno}", node))
    return found


def test_functions_stay_short_and_take_few_positional_parameters() -> None:
    """At most 2 functions over 60 lines (docstring included); none with more than 8
    positional parameters (options past those are keyword-only, as vLLM's `LLM(...)`)."""
    functions = _functions()
    lengths = {name: f.end_lineno - f.lineno + 1 for name, f in functions if f.end_lineno}
    long = sorted(name for name, n in lengths.items() if n > 60)
    assert len(long) <= 2, f"functions over 60 lines: {long}"
    wide = [
        name
        for name, f in functions
        if len([a for a in f.args.posonlyargs + f.args.args if a.arg not in ("self", "cls")]) > 8
    ]
    assert wide == [], "functions with more than 8 positional parameters"


def _class(module: str, name: str) -> ast.ClassDef:
    path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    pytest.fail(f"{module} defines no class {name}")


ROUTER_ROOMS = {
    "router.instances": "Instances",
    "router.loads": "Loads",
    "router.bursts": "Bursts",
    "router.following": "Follower",
    "router.changes": "Changes",
    "router.pd": "PrefillStep",
}
"""Each of the router's concerns in a file with its own small class (docs/architecture.md)."""


def test_the_router_is_rooms_not_one_object() -> None:
    assert len((PACKAGE / "router" / "core.py").read_text().splitlines()) < 500
    init = next(
        n for n in _class("router.core", "Router").body
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )  # fmt: skip
    members = {
        t.attr
        for n in ast.walk(init)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    assert len(members) <= 12, f"Router has {len(members)} members: {sorted(members)}"
    for module, cls in ROUTER_ROOMS.items():
        _class(module, cls)
    from kvconnect.router.scorer import Inputs, choose  # the scorer's inputs: one named value

    assert list(inspect.signature(choose).parameters)[:2] == ["candidates", "inputs"]
    assert Inputs.__dataclass_fields__


MUTATORS = {"append", "add", "pop", "discard", "clear", "update", "setdefault", "remove"}


def _written(node: ast.AST) -> list[ast.expr]:
    """What `node` writes to: assignment and deletion targets, a mutating call's object."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in MUTATORS
    ):
        targets = [node.func.value]
    else:
        return []
    return [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]


def _chain(expr: ast.expr) -> list[str]:
    """`self.router.loads.in_flight[n]` -> ["self", "router", "loads", "in_flight"]."""
    names: list[str] = []
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        if isinstance(expr, ast.Attribute):
            names.append(expr.attr)
        expr = expr.value
    names.append(expr.id if isinstance(expr, ast.Name) else "?")
    return names[::-1]


def test_no_router_module_writes_the_routers_members() -> None:
    """The router's state changes through its rooms' methods (`loads.sent`, `bursts.prefilled`,
    `router.record`), never by another module reaching in: `router.counts.x += 1`."""
    reaching = []
    for path in sorted((PACKAGE / "router").glob("*.py")):
        if path.name == "core.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _written(node):
                chain = _chain(target)
                through = chain[1:] if chain[0] == "self" else chain
                if "router" in through[:-1] or (chain[0] == "router" and len(chain) > 1):
                    reaching.append(f"{path.name}:{node.lineno} {'.'.join(chain)}")
    assert reaching == []


def test_the_peer_pull_has_a_room() -> None:
    """connector/offload/peers/: the transports, the sources, leases and `PeerSide`, the one
    object the worker calls; the worker keeps stores and loads."""
    code = code_modules()
    peers = {n for n in code if n.startswith("connector.offload.peers.")}
    rooms = ("protocol", "tcp", "curve", "transport", "sources", "side", "leases")
    assert {f"connector.offload.peers.{m}" for m in rooms} <= peers
    assert not any(n.startswith("connector.offload.tiers.peer") for n in code)
    _class("connector.offload.peers.side", "PeerSide")
    worker = PACKAGE / "connector" / "offload" / "worker.py"
    assert len(worker.read_text().splitlines()) < 600
    assert {"connector.offload.peers.tcp", "connector.offload.peers.curve"}.isdisjoint(
        code["connector.offload.worker"]
    ), "the worker reaches the transports through PeerSide only"
