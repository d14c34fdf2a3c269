"""Architectural rules, kept by tests: one module talks to torch.distributed, one branches on
the device type, imports go one way (within comm/, and between packages: no cycle), no package
imports what another keeps private, and the public API is listed in one place."""
from __future__ import annotations

import ast
from pathlib import Path

import shardtrain

SRC = Path(shardtrain.__file__).parent


def modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC).as_posix(), ast.parse(path.read_text())


def dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def uses(tree: ast.AST, prefix: str) -> bool:
    """Code (not strings) that imports or reaches ``prefix`` (e.g. torch.distributed)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.startswith(prefix) for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(prefix):
            return True
        if isinstance(node, ast.Attribute) and (dotted(node) == prefix
                                                or dotted(node).startswith(prefix + ".")):
            return True
    return False


# The DeepSpeed-compatible tree has one pass-through of each kind, with DeepSpeed's names, for
# scripts: deepspeed.comm (torch.distributed on any group) and deepspeed.accelerator
# (torch.cuda behind DeepSpeed's accelerator methods). The engine never uses either.
def test_only_comm_talks_to_torch_distributed():
    offenders = [name for name, tree in modules() if uses(tree, "torch.distributed")
                 and not name.startswith("comm/")]
    assert offenders == ["deepspeed/comm/comm.py"], offenders
    assert {name for name, _ in modules() if name.startswith("comm/")} == {
        "comm/__init__.py", *(f"comm/{m}.py" for m in COMM_ORDER)}


#: comm/'s modules, each importing only those before it: the trail's records and the roll
#: call (no torch.distributed), the process group, groups and their timeouts, then what goes
#: around every collective (SIGTERM's hold, this rank's trail, timing, the failure report, the
#: divergence check), and the collectives last.
COMM_ORDER = ["_trail", "_roll_call", "_process", "_groups", "_bounds", "_sigterm", "_tracing",
              "_timing", "_report", "_divergence", "_ops", "_traced"]


def test_comm_imports_go_one_way():
    """Each of comm/'s modules imports only those before it in :data:`COMM_ORDER` (type hints
    aside), and ``__init__`` gathers them."""
    order = COMM_ORDER
    for name, tree in modules():
        if not name.startswith("comm/_") or name == "comm/__init__.py":
            continue
        me = order.index(name[len("comm/"):-len(".py")])
        for node in runtime_nodes(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                targets = [node.module] if node.module else [a.name for a in node.names]
                for target in targets:
                    assert order.index(target) < me, (name, target)


def test_only_accelerator_branches_on_cuda():
    offenders = [name for name, tree in modules() if uses(tree, "torch.cuda")]
    assert offenders == ["accelerator.py", "deepspeed/accelerator/__init__.py"], offenders


def test_the_engine_never_imports_the_deepspeed_tree():
    importers = [name for name, tree in modules() if not name.startswith("deepspeed/")
                 and any(isinstance(n, ast.ImportFrom) and in_deepspeed_tree(
                     imported_module(name, n)) for n in runtime_nodes(tree))]
    assert set(importers) <= {"cli/_alias.py", "cli/_info.py"}, importers


def in_deepspeed_tree(module: str) -> bool:
    """``shardtrain.deepspeed`` (the alias tree) or a top-level ``deepspeed`` package; not a
    module that merely has the word in its name (``checkpoint._deepspeed_reader``)."""
    return any(module == root or module.startswith(root + ".")
               for root in ("deepspeed", "shardtrain.deepspeed"))


def runtime_nodes(tree: ast.AST):
    """Every node outside ``if TYPE_CHECKING:`` blocks (imports for type hints only)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and dotted(node.test).endswith("TYPE_CHECKING"):
            skip.update(id(n) for n in ast.walk(node))
    return [n for n in ast.walk(tree) if id(n) not in skip]


def imported_module(path: str, node: ast.ImportFrom) -> str:
    """The absolute name ``from ... import`` reads, for a module at ``path`` (relative to SRC)."""
    if node.level == 0:
        return node.module or ""
    package = ["shardtrain", *path.split("/")[:-1]]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def test_nothing_but_the_entry_points_imports_the_engine():
    """The entry points, and the pipeline engine, which is an engine (DeepSpeed's
    ``PipelineEngine`` is a ``DeepSpeedEngine`` too)."""
    importers = []
    for name, tree in modules():
        for node in runtime_nodes(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = imported_module(name, node)
            names = {a.name for a in node.names}
            if target == "shardtrain.engine" or (target == "shardtrain" and "engine" in names):
                importers.append(name)
    assert set(importers) <= {"__init__.py", "cli/__init__.py", "pipeline_engine.py"}, importers


def test_checkpoints_and_telemetry_read_no_private_engine_part():
    """They take the engine's public members only (``training_parts()``, ``monitor``...)."""
    readers = [name for name, tree in modules()
               if name.split("/")[0] in ("checkpoint", "telemetry", "autotune")
               for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and dotted(node.value) in ("engine", "self.engine", "parts")
               and node.attr.startswith("_")]
    assert not readers, readers


def module_name(path: str) -> str:
    """``shardtrain.comm._ops`` for ``comm/_ops.py``, ``shardtrain.comm`` for its ``__init__.py``."""
    return ".".join(["shardtrain", *path[:-len(".py")].split("/")]).removesuffix(".__init__")


def package_of(module: str) -> str:
    """The package that holds ``module`` (dotted, under ``shardtrain``): its first level below
    ``shardtrain`` when that is a package (``comm``, ``zero``...), else ``"shardtrain"``, the
    top level, whose modules (``engine.py``, ``accelerator.py``...) are one package here."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (SRC / parts[1]).is_dir() else "shardtrain"


def is_module(module: str) -> bool:
    path = SRC.joinpath(*module.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: str, tree: ast.AST, type_hints: bool = True):
    """``(module, name)`` for every import of a shardtrain module by the module at ``path``:
    ``name`` is the name taken from ``module`` (None when a module itself is imported, as
    ``from . import comm`` does). Without ``type_hints``, imports for type hints only are left
    out."""
    for node in (ast.walk(tree) if type_hints else runtime_nodes(tree)):
        if isinstance(node, ast.Import):
            found = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = imported_module(path, node)
            found = [(f"{base}.{a.name}", None) if is_module(f"{base}.{a.name}") else (base, a.name)
                     for a in node.names]
        else:
            continue
        yield from ((module, name) for module, name in found
                    if module == "shardtrain" or module.startswith("shardtrain."))


def is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def test_no_package_imports_what_another_keeps_private():
    """What a package shares is public in it (a module or a name without ``_``); its own
    ``_`` modules and names are its business only. Type hints count too."""
    found = set()
    for path, tree in modules():
        mine = package_of(module_name(path))
        for module, name in imports(path, tree):
            if package_of(module) == mine:
                continue
            if any(map(is_private, module.split(".")[1:])) or (name and is_private(name)):
                found.add((path, module))
    assert not found, sorted(found)


#: The attributes a parameter's layout is written to for DeepSpeed's readers; shardtrain itself
#: reads the record (shardtrain.layout.layout_of). Only layout/ writes them, and only zero/'s
#: own machinery reads the ZeRO ones.
#: (``tp_group`` is also the record's own field, so it is not listed.)
LAYOUT_ATTRIBUTES = {"ds_shape", "ds_numel", "ds_persist", "ds_process_group", "tp_split"}


def test_only_the_layout_record_says_where_a_parameter_lives():
    """Outside layout/ and zero/ no module reads or writes a parameter's layout attributes
    (``p.ds_shape``, ``getattr(p, "tp_split", ...)``): it reads ``layout_of(p)``."""
    found = []
    for path, tree in modules():
        if path.startswith(("layout/", "zero/")):
            continue
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and node.attr in LAYOUT_ATTRIBUTES:
                name = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant)
                  and node.args[1].value in LAYOUT_ATTRIBUTES):
                name = node.args[1].value
            if name is not None:
                found.append(f"{path}:{node.lineno} {name}")
    assert not found, found


def room_of(module: str) -> str:
    """For the cycle rule: a package below the top level, or one top-level module (each is a
    room of its own there: one package of them all would make a cycle of engine.py, which
    uses zero/, and accelerator.py, which zero/ uses); ``shardtrain`` itself for what
    ``__init__.py`` offers (``__version__``, ``initialize``)."""
    parts = module.split(".")
    if len(parts) == 1 or not is_module(".".join(parts[:2])):
        return "shardtrain"
    return parts[1]


def test_no_import_cycle_between_packages():
    """Imports between the rooms go one way (type hints aside): no package imports, through
    any chain of imports, a package that imports it back."""
    graph: dict = {}
    for path, tree in modules():
        me = room_of(module_name(path))
        for module, name in imports(path, tree, type_hints=False):
            target = room_of(f"{module}.{name}" if module == "shardtrain" and name else module)
            if target != me:
                graph.setdefault(me, {}).setdefault(target, path)
    for start in graph:
        cycle = _cycle_from(graph, start, [start])
        assert cycle is None, "import cycle: " + " -> ".join(
            f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def _cycle_from(graph: dict, start: str, path: list):
    for nxt in graph.get(path[-1], {}):
        if nxt == start:
            return path + [start]
        if nxt not in path:
            found = _cycle_from(graph, start, path + [nxt])
            if found:
                return found
    return None


def test_public_api_is_frozen():
    assert sorted(shardtrain.__all__) == sorted([
        "initialize", "init_distributed", "destroy", "Engine", "ShardConfig", "ConfigError",
        "load_config", "log_dist", "log_dist_once", "add_config_arguments", "comm",
        "accelerator", "zero", "checkpointing", "utils", "errors", "load_pretrained", "__version__"])


def test_the_deepspeed_surface_reads_only_the_engines_public_members():
    """``_engine_compat`` restates what the engine has under DeepSpeed's names: it reads
    the engine (``self``) through public members only, and holds no life cycle of its own."""
    tree = ast.parse((SRC / "_engine_compat.py").read_text())
    mixin = next(n for n in tree.body if isinstance(n, ast.ClassDef)
                 and n.name == "DeepSpeedEngineAPI")
    private = sorted({node.attr for node in ast.walk(mixin) if isinstance(node, ast.Attribute)
                      and dotted(node.value) == "self" and node.attr.startswith("_")
                      and node.attr != "__dict__"})
    assert not private, private
    names = {n.name for n in mixin.body if isinstance(n, ast.FunctionDef)}
    assert not names & {"destroy", "of_parameter", "optimizer_slot", "parameters_changed"}


def test_the_checkpoint_package_says_what_each_of_its_modules_does():
    """checkpoint/'s docstring divides the work among its modules: it names every one."""
    doc = ast.get_docstring(ast.parse((SRC / "checkpoint" / "__init__.py").read_text()))
    missing = [p.stem for p in (SRC / "checkpoint").glob("*.py")
               if p.stem != "__init__" and f"``{p.stem}``" not in doc
               and f":mod:`.{p.stem}`" not in doc]
    assert not missing, missing


# -- docs/architecture.md's rooms table ----------------------------------------------------------

ARCHITECTURE = SRC.parents[1] / "docs" / "architecture.md"
TABLE_HEADER = "| room | its one idea | uses |"


def room_uses() -> dict:
    """Each room's rooms imported at run time (type hints aside), as the cycle rule sees them;
    the top level's ``__init__.py`` is the room ``__init__``."""
    shown = {"shardtrain": "__init__"}
    found: dict = {}
    for path, tree in modules():
        me = shown.get(room_of(module_name(path)), room_of(module_name(path)))
        targets = found.setdefault(me, set())
        for module, name in imports(path, tree, type_hints=False):
            target = room_of(f"{module}.{name}" if module == "shardtrain" and name else module)
            targets.add(shown.get(target, target))
        targets.discard(me)
    return found


def table_rows(text: str):
    """``(line index, rooms of the row, its cells)`` for each row of the rooms table."""
    lines = text.splitlines()
    start = lines.index(TABLE_HEADER) + 2
    for i in range(start, len(lines)):
        if not lines[i].startswith("|"):
            break
        cells = [c.strip() for c in lines[i].strip("|").split("|")]
        names = [n.strip().strip("`") for n in cells[0].split(",")]
        yield i, {n.rstrip("/").removesuffix(".py") for n in names}, cells


def expected_uses(rooms: set, uses: dict) -> str:
    found = set().union(*(uses.get(r, set()) for r in rooms)) - rooms
    return ", ".join(f"`{r}`" for r in sorted(found)) or "-"


def test_the_rooms_table_lists_every_room_and_what_it_uses():
    """docs/architecture.md names every top-level module and package once, and its "uses"
    column is what each room imports (``python tests/unit/test_architecture.py --write``
    rewrites that column from the code)."""
    uses = room_uses()
    listed: list = []
    wrong = []
    for _, rooms, cells in table_rows(ARCHITECTURE.read_text()):
        listed.extend(rooms)
        if cells[2] != expected_uses(rooms, uses):
            wrong.append(f"{sorted(rooms)}: table says {cells[2]!r}, code {expected_uses(rooms, uses)!r}")
    assert sorted(listed) == sorted(uses), (sorted(set(uses) - set(listed)),
                                            sorted(set(listed) - set(uses)))
    assert not wrong, wrong


def _write_uses() -> None:
    uses = room_uses()
    lines = ARCHITECTURE.read_text().splitlines()
    for i, rooms, cells in list(table_rows("\n".join(lines))):
        cells[2] = expected_uses(rooms, uses)
        lines[i] = "| " + " | ".join(cells) + " |"
    ARCHITECTURE.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["--write"]:
        _write_uses()
        print(f"wrote {ARCHITECTURE}")
