"""No import cycles between polyrl's modules, counting every import statement wherever it sits.

The graph is read from the source with `ast`, so an import inside a function or under
`if TYPE_CHECKING:` is an edge like a top-level one: a cycle hidden from import time is still a cycle.
Third-party modules (torch, vllm, ray, ...) are not nodes; they cannot close a cycle through polyrl.
"""

import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "polyrl"


def module_name(path: Path, root: Path) -> str:
    """`polyrl/envs/base.py` -> `polyrl.envs.base`; a package's `__init__.py` is the package itself."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(tree: ast.Module, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that the statements in `tree` import, relative imports resolved.

    `from pkg import name` is an import of the submodule `pkg.name` when there is one, else of `pkg`
    (its `__init__`); an import of a name that is no module resolves to its longest known prefix.
    Importing `a.b.c` runs the `__init__` of `a` and `a.b` first, so those packages count as imported
    too, except the ones `module` itself sits in (they are already being imported when it runs);
    a package named outright is always an import of its `__init__`.
    """
    package = module if is_package else module.rpartition(".")[0]
    own_packages = {".".join(package.split(".")[:i]) for i in range(1, package.count(".") + 2)}
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
        while (name := name.rpartition(".")[0]) and name not in own_packages:
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in known else source)
    return found


def import_graph(root: Path = PACKAGE_DIR) -> nx.DiGraph:
    """Module -> imported module, for every `.py` file under `root` (a package directory)."""
    files = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for target in imported_modules(tree, module, path.name == "__init__.py", set(files)):
            if target != module:
                graph.add_edge(module, target)
    return graph


def import_cycles(graph: nx.DiGraph) -> list[list[str]]:
    """Each strongly connected component of more than one module, sorted: every module in one
    reaches every other through imports."""
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_cycle_finder_sees_a_cycle_hidden_in_a_function(tmp_path):
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/sub/__init__.py": "from .c import X\n",
            "pkg/sub/c.py": "X = 1\ndef f():\n    from ..a import b\n",
            "pkg/b.py": "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.sub\n",
            "pkg/leaf.py": "from pkg.a import b\n",
        },
    )
    graph = import_graph(pkg)
    assert set(graph.edges) == {
        ("pkg.a", "pkg.b"),
        ("pkg.sub", "pkg.sub.c"),
        ("pkg.sub.c", "pkg.a"),
        ("pkg.b", "pkg.sub"),
        ("pkg.leaf", "pkg.a"),
    }
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"]]


def test_cycle_finder_counts_the_package_init_a_submodule_import_runs(tmp_path):
    # pkg.y imports pkg.x.m, which runs pkg/x/__init__.py, which imports pkg.y back (lazily)
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/x/__init__.py": "def f():\n    from pkg.y import g\n",
            "pkg/x/m.py": "from pkg.x import f\n",
            "pkg/y.py": "from pkg.x.m import h\n",
        },
    )
    graph = import_graph(pkg)
    assert set(graph.edges) == {("pkg.x", "pkg.y"), ("pkg.x.m", "pkg.x"), ("pkg.y", "pkg.x.m"), ("pkg.y", "pkg.x")}
    assert import_cycles(graph) == [["pkg.x", "pkg.x.m", "pkg.y"]]


def test_cycle_finder_passes_a_graph_without_cycles(tmp_path):
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import a\n",
            "pkg/a.py": "from . import b\nfrom .b import name\nimport json\n",
            "pkg/b.py": "def f():\n    import pkg.c as c\n",
            "pkg/c.py": "import torch\nfrom pkg.sub.d import Y\n",
            "pkg/sub/__init__.py": "from pkg.sub.d import Y\n",
            "pkg/sub/d.py": "Y = 2\n",
        },
    )
    graph = import_graph(pkg)
    assert set(graph.edges) == {
        ("pkg", "pkg.a"),
        ("pkg.a", "pkg.b"),
        ("pkg.b", "pkg.c"),
        ("pkg.c", "pkg.sub.d"),
        ("pkg.c", "pkg.sub"),
        ("pkg.sub", "pkg.sub.d"),
    }
    assert import_cycles(graph) == []


@pytest.mark.slow
def test_polyrl_has_no_import_cycles():
    graph = import_graph()
    assert graph.number_of_nodes() > 50 and graph.number_of_edges() > 100  # the walk found the package
    cycles = import_cycles(graph)
    assert not cycles, "import cycles between polyrl modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


LAYERS = (
    # polyrl's packages (and top-level modules) from the bottom up: each imports only those listed before it.
    "types", "waits", "loader", "config", "models", "plan", "algorithms", "data", "rewards", "envs", "engines",
    "parallel", "checkpoint", "placement", "config_check", "rollout", "endpoint", "learner", "observe",
    "adapters", "train", "runtime", "run", "tinker_api", "docs_gen", "cli", "__main__", "polyrl",
)


def package_graph(graph: nx.DiGraph) -> nx.DiGraph:
    """Package -> imported package, from the module graph: `polyrl.train.step` belongs to `train`,
    a top-level module such as `polyrl.cli` is its own package, `polyrl` itself is the root package."""
    def package(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    packages = nx.DiGraph()
    packages.add_nodes_from(package(m) for m in graph.nodes)
    for source, target in graph.edges:
        if package(source) != package(target):
            packages.add_edge(package(source), package(target))
    return packages


def layer_violations(packages: nx.DiGraph, layers: tuple[str, ...]) -> list[str]:
    """Each import of a package at or above the importer's place in `layers`, and each package missing from it."""
    missing = sorted(set(packages.nodes) - set(layers))
    place = {name: i for i, name in enumerate(layers)}
    upward = sorted(f"{a} imports {b}" for a, b in packages.edges
                    if a in place and b in place and place[b] >= place[a])
    return [f"{name} has no place in LAYERS" for name in missing] + upward


def test_layer_check_reports_an_upward_import_and_an_unplaced_package(tmp_path):
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": "import json\n",
            "pkg/high/__init__.py": "",
            "pkg/high/b.py": "from pkg.low.a import x\n",
            "pkg/low/c.py": "def f():\n    from pkg.high import b\n",
            "pkg/stray.py": "from pkg.low import a\n",
        },
    )
    packages = package_graph(import_graph(pkg))
    assert ("high", "low") in packages.edges and ("low", "high") in packages.edges
    assert layer_violations(packages, ("low", "high", "pkg")) == ["stray has no place in LAYERS", "low imports high"]
    assert layer_violations(packages, ("low", "high", "stray", "pkg")) == ["low imports high"]


@pytest.mark.slow
def test_polyrl_packages_import_only_downwards():
    packages = package_graph(import_graph())
    assert {"train", "learner", "run", "envs"} <= set(packages.nodes)
    cycles = sorted(sorted(c) for c in nx.strongly_connected_components(packages) if len(c) > 1)
    assert not cycles, "import cycles between polyrl packages: " + "; ".join(" <-> ".join(c) for c in cycles)
    violations = layer_violations(packages, LAYERS)
    assert not violations, "package imports against the order of LAYERS:\n" + "\n".join(violations)
