"""The package's shape, checked without engines: which side imports what, the old flat names,
the kind table, the fields every view derives from, the executor's action table.

    python -m pytest tests/test_layout.py
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

import pytest
import torch

import labkit
from labkit import engine
from labkit.analysis import events, metrics
from labkit.cli import build_parser, strategy_from_args
from labkit.config import Strategy, strategy_fields
from labkit.errors import LabError, RankReport
from labkit.parallel.build import RunSpec
from labkit.parallel.executor import Executor
from labkit.parallel.pipeline.schedules import SCHEDULES, build_schedule, simulate

ROOT = Path(labkit.__file__).parent
ENGINE_SIDE = ("engine", "parallel", "comm", "record", "models", "data")
NOTEBOOK_SIDE = ("session", "run", "view", "plan", "cli", "widgets")
FORBIDDEN_IN_PURE = ("torch.distributed", "ipyparallel")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def run_at_import(node):
    """The statements of ``node`` that run when its module is imported: not function bodies,
    not ``if TYPE_CHECKING:`` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue
        yield child
        yield from run_at_import(child)


def imports_of(path: Path, package: str | None = None, at_import: bool = False) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (also inside functions; with
    ``at_import``, only where importing the module runs it), resolved (relative imports against
    ``package``, by default the file's own)."""
    if package is None:
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in (run_at_import(tree) if at_import else ast.walk(tree)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else node.module
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)   # "from . import comm"
    return found


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def closure(start: str) -> set[str]:
    """The labkit modules ``start`` reaches through its imports (transitively)."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in MODULES or name == "labkit":     # the facade imports everything
            continue
        seen.add(name)
        todo += [m for m in imports_of(MODULES[name]) if m.startswith("labkit")]
    return seen


def side(name: str) -> str | None:
    top = name.split(".")[1] if "." in name else ""
    return "engine" if top in ENGINE_SIDE else "notebook" if top in NOTEBOOK_SIDE else None


# -- import directions ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("labkit.analysis")))
def test_analysis_is_pure_all_the_way_down(name):
    for reached in closure(name):
        bad = [m for m in imports_of(MODULES[reached]) if m.startswith(FORBIDDEN_IN_PURE)]
        assert not bad, f"{name} reaches {reached}, which imports {bad}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("labkit.view")))
def test_view_code_never_imports_torch_distributed_or_ipyparallel(name):
    bad = [m for m in imports_of(MODULES[name]) if m.startswith(FORBIDDEN_IN_PURE)]
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if side(n) == "engine"))
def test_engine_side_never_imports_notebook_side(name):
    bad = sorted(m for m in closure(name) if side(m) == "notebook")
    assert not bad, f"{name} reaches notebook-side {bad}"


def _layer(name: str) -> str:
    return name.split(".")[1] if name.startswith("labkit.") else ""


def run_view_crossings(name: str, found: set[str]) -> list[str]:
    """The imports of module ``name`` (in run/ or view/) that reach the other of the two."""
    other = {"run": "view", "view": "run"}.get(_layer(name))
    return sorted(m for m in found if other and _layer(m) == other)


def matplotlib_imports(found: set[str]) -> list[str]:
    return sorted(m for m in found if m.split(".")[0] == "matplotlib")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _layer(n) in ("run", "view")))
def test_run_and_view_never_import_each_other(name):
    """The run driver and the views are separate layers: what both need lives below them
    (analysis/, config), and what wires them together above them (widgets.py, cli.py)."""
    bad = run_view_crossings(name, imports_of(MODULES[name]))
    assert not bad, f"{name} imports {bad}: move what both need below them or the wiring above them"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _layer(n) == "analysis"))
def test_analysis_never_imports_matplotlib(name):
    """analysis/ is data: it draws through labkit.view (imported where a plot is asked for)."""
    bad = matplotlib_imports(imports_of(MODULES[name]))
    assert not bad, f"{name} imports {bad}; draw in labkit.view and call it from a plot() method"


def test_the_scans_fire_on_a_bad_import(tmp_path):
    """Both scans find what they look for, inside a function and relative too."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import matplotlib.pyplot as plt\n    from ..run.live import LiveRunner\n")
    found = imports_of(bad, package="labkit.view")
    assert run_view_crossings("labkit.view.bad", found) == ["labkit.run.live", "labkit.run.live.LiveRunner"]
    assert matplotlib_imports(found) == ["matplotlib.pyplot"]


# -- one rank grid -----------------------------------------------------------------------------------
AXES = {"dp", "pp", "cp", "tp"}


def _is_axis(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in AXES or isinstance(node, ast.Name) and node.id in AXES


def _times_axis(node) -> bool:
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and (_is_axis(node.left) or _is_axis(node.right))


def grid_arithmetic(path: Path) -> list[int]:
    """Lines of ``path`` that turn a rank into grid coordinates or back: a divmod by an axis's
    degree, an index ``rank // stride % degree``, or Horner's nesting ``(d·pp + p)·cp`` of a
    rank's index."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "divmod" \
                and any(_is_axis(n) for a in node.args[1:] for n in ast.walk(a)):
            lines.append(node.lineno)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and _is_axis(node.right) \
                and isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.FloorDiv):
            lines.append(node.lineno)
        elif _times_axis(node) and any(isinstance(side, ast.BinOp) and isinstance(side.op, ast.Add)
                                       and (_times_axis(side.left) or _times_axis(side.right))
                                       for side in (node.left, node.right)):
            lines.append(node.lineno)
    return lines


def test_one_module_holds_the_rank_grid_and_it_imports_nothing_heavy():
    """labkit.grid lays ranks out for the engine, the timeline and the planner; importing it
    runs no torch (engine/__init__ would pull torch.distributed in)."""
    held = {name: grid_arithmetic(path) for name, path in MODULES.items()}
    assert held["labkit.grid"], "the scan no longer finds labkit.grid's own arithmetic"
    elsewhere = {name: lines for name, lines in held.items() if lines and name != "labkit.grid"}
    assert not elsewhere, f"rank-grid arithmetic outside labkit.grid: {elsewhere}; use ParallelDims"
    assert {m.split(".")[0] for m in imports_of(MODULES["labkit.grid"])} <= {"__future__", "dataclasses", "itertools"}


def test_the_grid_scan_fires_on_a_rank_formula(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def rank(d, p, c, t, g):\n    return ((d * g.pp + p) * g.cp + c) * g.tp + t\n\n\n"
                   "def coords(rank, g):\n    return divmod(rank, g.cp * g.tp)\n\n\n"
                   "def cp_index(rank, g):\n    return rank // g.tp % g.cp\n")
    assert sorted(set(grid_arithmetic(bad))) == [2, 6, 10]
    fine = tmp_path / "fine.py"
    fine.write_text("rows = dims.dp * dims.tp\ny = 1.3 * (dp_i * dims.tp + tp_i)\n")     # a drawing's rows
    assert grid_arithmetic(fine) == []


# -- no package import cycle -------------------------------------------------------------------------
# models/ <-> parallel/: gpt and llama call parallel.context.attention (the cp contract), and the ep
# axis's layer subclasses models.moe.MoE. Left until the axis protocol moves the contract down.
KNOWN_CYCLES = []


def package_of(name: str) -> str:
    """labkit.parallel.pipeline.stages -> labkit.parallel; labkit.config -> labkit.config."""
    return ".".join(name.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    """labkit's packages (and top-level modules), each to those it imports at module level."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if name == "labkit":            # the facade imports everything, and nothing imports it back
            continue
        edges = graph.setdefault(package_of(name), set())
        edges.update(package_of(m) for m in imports_of(path, at_import=True)
                     if m.startswith("labkit.") and (m in MODULES or m.rsplit(".", 1)[0] in MODULES))
    return {a: b - {a} for a, b in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of more than one node (each package reaches every other)."""
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {a: reach(a) for a in graph}
    groups = {frozenset({a} | {b for b in reached[a] if a in reached.get(b, ())}) for a in graph}
    return sorted((set(g) for g in groups if len(g) > 1), key=sorted)


def test_no_package_import_cycle_at_module_level():
    """Imports that run at import time go one way between packages (the event schema and the
    rank grid at the bottom); the one cycle left is named above, and none may join it."""
    found = cycles(package_graph())
    assert found == KNOWN_CYCLES, f"package import cycles {found}; break them with a lower module"


def test_the_event_schema_is_at_the_bottom():
    """analysis/events.py imports nothing of labkit, and it is all the engine side's recorders
    (comm/, record/) take from analysis/: analysis/ reads events, it does not feed them."""
    assert not [m for m in imports_of(MODULES["labkit.analysis.events"]) if m.startswith("labkit")]
    for name, path in MODULES.items():
        if _layer(name) in ("comm", "record"):
            taken = sorted(m for m in imports_of(path) if _layer(m) == "analysis"
                           and m.split(".")[:3] != ["labkit", "analysis", "events"])
            assert not taken, f"{name} imports {taken} from analysis/; only the event schema is below comm/ and record/"


def test_the_cycle_scan_fires_and_skips_what_import_does_not_run(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []
    mod = tmp_path / "m.py"
    mod.write_text("from typing import TYPE_CHECKING\nimport json\nif TYPE_CHECKING:\n    import labkit.config\n"
                   "def f():\n    import labkit.run\n")
    assert imports_of(mod, package="labkit", at_import=True) == {"typing", "typing.TYPE_CHECKING", "json"}
    assert "labkit.run" in imports_of(mod, package="labkit")


def test_the_old_flat_names_are_gone_and_the_public_ones_stay():
    old = ("labkit._moved", "labkit.strategies", "labkit.job", "labkit.runner", "labkit.models.training",
           "labkit.metrics", "labkit.timeline")
    assert not set(old) & set(MODULES)
    users = [*MODULES.values(), *(p for d in ("tests", "benchmarks", "scripts") for p in (ROOT.parent / d).glob("*.py"))]
    for path in users:
        assert not {m for m in imports_of(path) if m.startswith(old)}, path
    assert labkit.schedules is importlib.import_module("labkit.parallel.pipeline.schedules")
    assert labkit.diagnose is importlib.import_module("labkit.analysis.diagnose")
    assert labkit.widgets is importlib.import_module("labkit.widgets")


# -- one name, one thing --------------------------------------------------------------------------
def class_definitions(paths, name=module_name) -> dict[str, list[str]]:
    """Every class name defined in ``paths`` (nested ones too) → the modules that define it."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(name(path))
    return found


def test_no_class_name_is_defined_twice_outside_models():
    """A name says one thing (a Link is the emulated interconnect; the planner's α-β pair and the
    pipeline's channel have names of their own). models/ may repeat a part's name per model."""
    defined = class_definitions(MODULES.values())
    twice = {name: where for name, where in defined.items()
             if len(where) > 1 and any(not m.startswith("labkit.models") for m in where)}
    assert not twice, f"class names defined more than once: {twice}; give each thing its own name"


def test_the_class_scan_fires_on_a_repeated_name(tmp_path):
    (tmp_path / "a.py").write_text("class Link:\n    pass\n")
    (tmp_path / "b.py").write_text("def f():\n    class Link:\n        pass\n")
    found = class_definitions([tmp_path / "a.py", tmp_path / "b.py"], name=lambda path: path.stem)
    assert found == {"Link": ["a", "b"]}


# -- file size -------------------------------------------------------------------------------------------
MAX_LINES = 500


def test_no_module_is_over_500_lines():
    """A file reads top to bottom (picotron's ~160-line median); past 500 lines it holds two things."""
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}; split them by role"


# -- the README's layout block ---------------------------------------------------------------------
FOLDER = re.compile(r"(?<![\w/.])(\w+)/(?!\w)")          # "engine/", not "docs/design.md"
FILE = re.compile(r"(?<![\w/.])(\w+\.(?:py|md|sh))\b")


def layout_entries(block: str) -> dict[str, str]:
    """A layout block's top folders, each with its text (continuation lines joined)."""
    entries: dict[str, str] = {}
    for line in block.splitlines():
        if line and not line[0].isspace():
            top, _, text = line.partition("/")
            entries[top] = text
        elif line.strip():
            entries[top] += " " + line.strip()
    return entries


def layout_problems(block: str, repo: Path) -> list[str]:
    """Where a layout block and the tree at ``repo`` disagree: a folder or file it names that is
    not there, a package of labkit or a model module it leaves out, a notebook range that is not
    the notebooks'."""
    problems, entries = [], layout_entries(block)
    for top, text in entries.items():
        under = list((repo / top).rglob("*"))
        dirs = {p.name for p in under if p.is_dir()}
        files = {p.name for p in under if p.is_file()}
        problems += [f"{top}/ has no folder {d}/" for d in sorted(set(FOLDER.findall(text)) - dirs)]
        problems += [f"{top}/ has no file {f}" for f in sorted(set(FILE.findall(text)) - files)]
    package = repo / "labkit"
    named = set(FOLDER.findall(entries.get("labkit", "")))
    problems += [f"labkit/ leaves out {p}/" for p in sorted({i.parent.name for i in package.rglob("__init__.py")}
                                                            - {"labkit"} - named)]
    listed = re.search(r"models/ \(([^)]*)\)", entries.get("labkit", ""))
    listed = {n.strip() for n in listed.group(1).split(",")} if listed else set()
    with_classes = {p.stem for p in (package / "models").glob("*.py") if p.stem != "__init__"
                    and any(isinstance(n, ast.ClassDef) for n in ast.parse(p.read_text()).body)}
    problems += [f"models/ leaves out {m}" for m in sorted(with_classes - listed)]
    numbers = sorted(int(p.name.split("_")[0]) for p in (repo / "notebooks").glob("[0-9]*.ipynb"))
    span = re.search(r"(\d+)_… to (\d+)_…", entries.get("notebooks", ""))
    if not span or (int(span[1]), int(span[2])) != (numbers[0], numbers[-1]):
        problems.append(f"notebooks/ are {numbers[0]:02d}_… to {numbers[-1]:02d}_…")
    return problems


def readme_layout_block() -> str:
    text = (ROOT.parent / "README.md").read_text()
    return text.split("## Layout\n\n```\n", 1)[1].split("```", 1)[0]


def test_the_readme_layout_block_holds_against_the_tree():
    assert layout_problems(readme_layout_block(), ROOT.parent) == []
    listed = re.search(r"models/ \(([^)]*)\)", layout_entries(readme_layout_block())["labkit"]).group(1)
    assert all((ROOT / "models" / f"{n.strip()}.py").exists() or hasattr(labkit.models, n.strip())
               for n in listed.split(","))


def test_the_layout_check_fires_on_a_stale_block():
    stale = ("labkit/        engine/ (rank grid) → parallel/ (data/, pipeline/); models/ (mlp,\n"
             "               gpt), widgets.py, gone.py\n"
             "notebooks/     the course, 00_… to 11_…\n"
             "docs/          design.md, security.md\n")
    problems = layout_problems(stale, ROOT.parent)
    assert "labkit/ has no file gone.py" in problems and "docs/ has no file security.md" in problems
    assert "labkit/ leaves out expert/" in problems and "models/ leaves out llama" in problems
    assert any(p.startswith("notebooks/ are 00_… to") for p in problems)


# -- the kind table -------------------------------------------------------------------------------
DESIGN_KINDS = ("fwd", "bwd", "bwd_input", "bwd_weight", "attention", "optimizer", "allreduce", "reduce_scatter",
                "allgather", "broadcast", "all_to_all", "send", "recv", "wait", "compress", "decompress", "checkpoint")


def test_the_kind_table_holds_design_kinds_once_and_every_view_reads_it():
    from labkit.record.recorder import Recorder
    from labkit.view.timeline import PALETTE

    assert tuple(events.KINDS) == DESIGN_KINDS
    assert PALETTE == {k: row.color for k, row in events.KINDS.items()}
    assert metrics.SEND_KINDS == {k for k, row in events.KINDS.items() if row.moves_bytes}
    assert {events.kind_of_call(c) for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                             "send", "recv")} <= set(events.KINDS)
    rec = Recorder(rank=0)
    rec.add("allreduce", "bucket 0", 0.0, 1.0)
    rec.add("fwd", "F0", 0.0, 1.0)
    assert [e["stream"] for e in rec.drain()] == ["comm", "compute"]    # streams from the table
    simulated = simulate(build_schedule("1f1b", stages=2, microbatches=2), 1, 2, 0.5)
    assert {e["kind"] for e in simulated} <= set(events.KINDS)
    assert {e["stream"] for e in simulated if e["kind"] in events.KINDS} == {"compute", "comm"}
    assert all(events.stream_of(e["kind"]) == e["stream"] for e in simulated)


# -- one declaration per Strategy field ----------------------------------------------------------------
def test_every_strategy_field_has_a_cli_flag_and_round_trips():
    s = Strategy(dp=2, pp=2, microbatches=4, dp_mode="bucketed", bucket_mb=0.5, compression="int8",
                 error_feedback=False, split_at=(3,))
    argv = ["run"]
    for f in strategy_fields():
        value = getattr(s, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, tuple):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    assert strategy_from_args(build_parser().parse_args(argv)) == s


def test_dashboard_controls_and_labels_come_from_the_field_metadata():
    pytest.importorskip("ipywidgets")
    from labkit.widgets import STRATEGY_FIELDS

    assert STRATEGY_FIELDS == tuple(f.name for f in strategy_fields() if f.metadata["control"])
    assert "error_feedback" in STRATEGY_FIELDS
    assert Strategy(dp=2, pp=2, microbatches=4).label() == "dp=2 pp=2 1f1b mb=4 overlap 1 MiB"
    assert Strategy(dp=2, dp_mode="naive").label() == "dp=2 mb=1 naive"
    assert "int8" in Strategy(dp=2, compression="int8").label()
    assert "pp=" not in Strategy(dp=2).label()


def test_each_axis_checks_its_own_fields_through_strategy():
    with pytest.raises(ValueError, match=r"Strategy\.compression"):          # the dp axis's rule
        Strategy(dp=2, dp_mode="naive", compression="fp16")
    with pytest.raises(ValueError, match=r"Strategy\.split_at"):             # the pp axis's rule
        Strategy(pp=2, split_at=(2, 1))
    with pytest.raises(ValueError, match=r"Strategy\.sequence_parallel"):   # the tp axis's rule
        Strategy(tp=2, tp_mode="dtensor", sequence_parallel=True)
    with pytest.raises(ValueError, match=r"Strategy\.tp_mode"):                # the tp axis's rule
        Strategy(dp=2, tp=2, tp_mode="dtensor")
    with pytest.raises(ValueError, match=r"Strategy\.zero"):
        Strategy(zero=1)
    assert dataclasses.replace(Strategy(pp=2), split_at=[2]).split_at == (2,)


# -- the executor -------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_executor_has_a_handler_for_every_action_of_every_schedule(schedule):
    chunks = 2 if schedule in ("interleaved", "zbv") else 1
    for actions in build_schedule(schedule, stages=2, microbatches=4, chunks=chunks):
        assert {a.op for a in actions} <= Executor.HANDLERS.keys()
        assert all(hasattr(Executor, method) for method in Executor.HANDLERS.values())


def executor_for(strategy: Strategy, batch: int, rows: int) -> Executor:
    data = lambda step: (torch.zeros(rows, 2), torch.zeros(rows, 2))  # noqa: E731
    spec = RunSpec(strategy, labkit.models.mlp(width=2, depth=2), batch=batch)
    return Executor(spec, [], 0, [], None, data, None, None, None, None, "cpu", 0, True)


@pytest.mark.parametrize("strategy", [Strategy(dp=2), Strategy(pp=2), Strategy(dp=2, pp=2)])
def test_dp_and_pp_take_and_refuse_the_same_data(strategy):
    x, _ = executor_for(strategy, batch=8, rows=8).batch(0)
    assert x.shape[0] == 8 // strategy.dp
    with pytest.raises(ValueError, match="batch=8"):
        executor_for(strategy, batch=8, rows=6).batch(0)


def test_a_stray_step_never_runs_another_runs_job():
    s = engine.session()
    s.job, s.run_id = object(), "run-a"
    try:
        with pytest.raises(RuntimeError, match="belongs to run run-b but run run-a is set up"):
            engine.run_step(0, "run-b")
    finally:
        s.job, s.run_id = None, None


# -- the status line names the root cause ----------------------------------------------------------------
class Hang:
    op, name, step, reached, not_reached = "barrier", "start of step 1", 1, [0], [1]


def test_the_status_names_the_rank_that_caused_it_not_a_peer_that_waited():
    from labkit.run.live import describe_error

    echo = RankReport(0, "CollectiveTimeout", "rank 0, step 1: barrier timed out after 3 s")
    own = RankReport(1, "RuntimeError", "bad data on purpose")
    assert describe_error(LabError("x", [echo, own])).startswith("rank 1: RuntimeError: bad data")
    timeout = LabError("x", [echo])
    timeout.hang = Hang()
    assert describe_error(timeout).startswith("rank 1 never reached barrier 'start of step 1' (step 1)")
    assert describe_error(LabError("x", [echo])).startswith("rank 0: CollectiveTimeout")
