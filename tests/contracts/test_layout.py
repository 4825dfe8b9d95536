"""The layout stays true: gspo's packages import only down, and no two modules import each other.

Ranks, bottom to top (gspo/__init__.py says what each package is). A module may import from its
own package or from a package of a lower rank; modules of one rank never import each other's
package. Inside a package with folders the same holds between its folders (FLOORS; the package's __init__ says what
each folder holds). Every import counts: at module level, inside functions, and under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

ROOT = REPO / "gspo"
RANK = {"core": 0, "config": 1, "tasks": 2, "algos": 2, "models": 2, "rollout": 3, "train": 4, "results": 5}
# the folders of a package, bottom to top ("": its modules outside any folder): a module imports its own folder or a
# folder of a lower floor; folders of one floor never import each other
FLOORS = {
    # child processes and decoding know nothing of each other; the engine uses both; the batch, its sources and the
    # rollout workers (batch.py, source.py, workers.py, worker.py) use any of them
    "rollout": {"processes": 0, "decoding": 0, "engine": 1, "": 2},
    # a run's files (checkpoints, resume, stop signals, failure records) < ranks < held-out evaluation < the starting
    # model and preflight < the loop, which uses them all
    "train": {"run": 0, "ranks": 1, "evaluation": 2, "start": 3, "": 3, "loop": 4},
}


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the gspo package (a package as its __init__)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The gspo modules a file imports (`from gspo.x import y` names module gspo.x.y when there is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gspo")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gspo") and not node.level:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _folder(module: str) -> str:
    """The folder of its package a module lives in ("" for one outside any folder, or for the package itself)."""
    rel = MODULES[module].relative_to(ROOT / _package(module)) if _package(module) else Path()
    return rel.parts[0] if len(rel.parts) > 1 else ""


def test_every_package_has_a_rank():
    packages = {_package(m) for m in MODULES if _package(m) and (ROOT / _package(m)).is_dir()}
    assert packages == set(RANK), "a package was added or removed: give it a rank here and in gspo/__init__.py"
    assert {_package(m) for m in MODULES} - {None} == set(RANK), "every module lives in a package"


def _upward(module: str, imports: set[str]) -> list[str]:
    """The imports of `module` that point to its own level or above, in another package."""
    here = _package(module)
    return sorted(t for t in imports if t != "gspo" and _package(t) != here and RANK[_package(t)] >= RANK[here])


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _package(m)))
def test_imports_point_down(module):
    up = _upward(module, GRAPH[module])
    here = _package(module)
    assert not up, f"{module} ({here}, rank {RANK[here]}) imports {up}: a part may import only parts below it"


def test_every_folder_has_a_floor():
    for package in RANK:
        folders = {p.name for p in (ROOT / package).iterdir() if (p / "__init__.py").is_file()}
        if folders:
            assert package in FLOORS, f"gspo/{package}/ has folders {sorted(folders)}: give them floors in FLOORS"
    for package, floors in FLOORS.items():
        folders = {p.name for p in (ROOT / package).iterdir() if (p / "__init__.py").is_file()}
        assert folders | {""} == set(floors), f"a folder of gspo/{package}/ was added or removed: give it a floor here"


def _downstairs(module: str, imports: set[str]) -> list[str]:
    """The imports of `module` that point to its package's folders on its own floor or above, other than its own."""
    floors = FLOORS.get(_package(module))
    if floors is None:
        return []
    here = _folder(module)
    return sorted(t for t in imports if t in MODULES and _package(t) == _package(module) and _folder(t) != here
                  and floors[_folder(t)] >= floors[here])


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _package(m) in FLOORS))
def test_imports_inside_a_package_point_down_its_floors(module):
    up = _downstairs(module, GRAPH[module])
    here = _folder(module) or "(no folder)"
    assert not up, (f"{module} ({here}, floor {FLOORS[_package(module)][_folder(module)]}) imports {up}: a folder may "
                    "import only its own folder and folders below it")


def test_the_floor_check_sees_upward_and_sideways_imports():
    """The checker itself: from decoding/, an import of the engine (above) and of processes/ (beside) are flagged,
    one of its own folder and one of another package are not; from run/, the loop (above) is."""
    imports = {"gspo.rollout.engine.client", "gspo.rollout.processes.child", "gspo.rollout.decoding.params",
               "gspo.models.moe"}
    assert _downstairs("gspo.rollout.decoding.generate", imports) == ["gspo.rollout.engine.client",
                                                                      "gspo.rollout.processes.child"]
    assert _downstairs("gspo.train.run.checkpoint", {"gspo.train.loop.trainer", "gspo.core.files"}) == [
        "gspo.train.loop.trainer"]
    assert _downstairs("gspo.train.loop.trainer", {"gspo.train.run.checkpoint", "gspo.train.preflight"}) == []


@pytest.mark.parametrize("package", sorted(m for m in MODULES if MODULES[m].name == "__init__.py"))
def test_every_package_says_what_it_holds(package):
    """Every package and folder opens with a docstring saying what it holds (where a newcomer looks first)."""
    assert ast.get_docstring(ast.parse(MODULES[package].read_text())), f"{package}: its __init__.py has no docstring"


def test_no_module_imports_one_that_imports_it():
    """No circles of any length, lazy and type-only imports included."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(GRAPH.get(m, ())):
            if t == m or t not in GRAPH:
                continue
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(t):] + [m, t]))
            if t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [])


def test_the_check_sees_upward_and_sideways_imports(tmp_path):
    """The checker itself: a lazy import up (algos -> train), a type-only one sideways (algos -> models)
    and one down (algos -> core) in a planted file: the first two are flagged, the third is not."""
    planted = tmp_path / "x.py"
    planted.write_text(
        "from typing import TYPE_CHECKING\n"
        "from gspo.core.errors import ConfigError\n"
        "if TYPE_CHECKING:\n    from gspo.models.moe import is_moe\n"
        "def f():\n    from gspo.train.loop import trainer\n"
    )
    imports = _imports(planted)
    assert imports == {"gspo.core.errors", "gspo.models.moe", "gspo.train.loop.trainer"}
    assert _upward("gspo.algos.x", imports) == ["gspo.models.moe", "gspo.train.loop.trainer"]


# --------------------------------------------------------------------------- sampling: one interface


DECODER_METHODS = {"sample", "continue_sequences", "stop_ids", "sample_rollout"}


def _calls(tree: ast.AST, match) -> list[tuple[str, int]]:
    """(enclosing function or class.function, line) of every call `match(call)` accepts."""
    found = []

    def walk(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = f"{where}.{child.name}".lstrip(".") if isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else where
            if isinstance(child, ast.Call) and match(child):
                found.append((here, child.lineno))
            walk(child, here)

    walk(tree, "")
    return found


def _hasattr_on_a_decoder_method(call: ast.Call) -> bool:
    return isinstance(call.func, ast.Name) and call.func.id == "hasattr" and len(call.args) == 2 \
        and isinstance(call.args[1], ast.Constant) and call.args[1].value in DECODER_METHODS


def _builds_a_rollout(call: ast.Call) -> bool:
    return isinstance(call.func, ast.Name) and call.func.id == "Rollout"


def test_a_decoder_is_found_by_its_type_never_by_its_attributes():
    """gspo/rollout/decoding/decoder.py: an engine is a `Decoder` subclass; nothing asks an object whether it has a
    decoder's method to decide how it samples."""
    found = {f"{name}:{where}:{line}" for name, path in MODULES.items()
             for where, line in _calls(ast.parse(path.read_text()), _hasattr_on_a_decoder_method)}
    assert not found, f"hasattr-dispatch on a sampler: {sorted(found)}"


def test_every_sampled_rollout_is_built_in_one_place():
    """`generate.assemble` makes every sampled Rollout (gspo's decoders, the engine's, trajectories with tools);
    besides it only re-shapings of finished rollouts construct one (concatenation, a checkpoint's batch)."""
    found = {f"{name}:{where}" for name, path in MODULES.items()
             for where, _ in _calls(ast.parse(path.read_text()), _builds_a_rollout)}
    assert found == {"gspo.rollout.decoding.generate:assemble", "gspo.rollout.decoding.generate:cat_rollouts",
                     "gspo.rollout.batch:Batch.from_state"}


def test_the_sampling_checks_see_what_they_look_for():
    """The checkers themselves, on planted code."""
    tree = ast.parse("def f(m):\n    if hasattr(m, 'sample_rollout'):\n        return Rollout(1)\n"
                     "class B:\n    def g(self):\n        return hasattr(self, 'weight') and Rollout(2)\n")
    assert _calls(tree, _hasattr_on_a_decoder_method) == [("f", 2)]
    assert _calls(tree, _builds_a_rollout) == [("f", 3), ("B.g", 6)]

# --------------------------------------------------------------------------- the loop never knows the loss

ALGOS = ROOT / "algos"
CLI = ROOT.parent / "cli"


def _loss_name_tests(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines that compare something named `loss` (`cfg.algo.loss`, `loss_name`) with a registered loss's name, or
    a collection of them (`algo.loss == "rspo"`, `loss in ("sapo", "dro")`)."""
    def about_loss(e: ast.expr) -> bool:
        return (isinstance(e, ast.Attribute) and "loss" in e.attr) or (isinstance(e, ast.Name) and "loss" in e.id)

    def a_name(e: ast.expr) -> bool:
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return any(a_name(x) for x in e.elts)
        return isinstance(e, ast.Constant) and e.value in names

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(about_loss(e) for e in sides) and any(a_name(e) for e in sides):
                found.append(node.lineno)
    return found


def test_nothing_outside_the_losses_tests_a_loss_by_name():
    """What a loss reads (its settings, the batch's top-k log-probs, the router shift) and what it allows (`delta`)
    is its LossSpec's to say: the loop, the checks and the CLI ask the registry, never `algo.loss == NAME`."""
    from gspo.algos.losses import loss_names

    names = set(loss_names())
    files = [p for p in [*ROOT.rglob("*.py"), *CLI.rglob("*.py")] if ALGOS not in p.parents]
    found = [f"{p.relative_to(ROOT.parent)}:{line}" for p in files
             for line in _loss_name_tests(ast.parse(p.read_text()), names)]
    assert found == [], f"a loss tested by its name (ask its LossSpec instead): {found}"


def test_the_loss_name_scan_sees_a_name_test():
    planted = ast.parse('if cfg.algo.loss == "rspo":\n    pass\n'
                        'x = loss_name in ("sapo", "dro")\ny = cfg.algo.advantage == "grpo"\nz = mode == "grpo"\n')
    assert _loss_name_tests(planted, {"rspo", "sapo", "dro", "grpo"}) == [1, 3]


def test_every_batch_source_has_the_protocols_methods():
    """`Inline` and `WorkerPool` are what gspo.train.loop.components.BatchSource says a batch source is: the same
    methods with the same parameters (a Protocol is not checked at run time; this is the check)."""
    import inspect

    from gspo.rollout.source import Inline
    from gspo.rollout.workers import WorkerPool
    from gspo.train.loop.components import BatchSource

    methods = [n for n, f in vars(BatchSource).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert sorted(methods) == ["batch", "close", "pending", "start", "updated"]
    for source in (Inline, WorkerPool):
        for name in methods:
            want = list(inspect.signature(getattr(BatchSource, name)).parameters)
            assert list(inspect.signature(getattr(source, name)).parameters) == want, (source.__name__, name)
