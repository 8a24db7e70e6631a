"""The public Python API: `polyrl.PUBLIC`, documented on docs/api.md, and the only way benchmarks and examples
import polyrl.

The scripts are read with `ast`, so an import inside a function counts like a top-level one."""

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import polyrl

ROOT = Path(__file__).resolve().parent.parent
API_PAGE = ROOT / "docs" / "api.md"


def scripts() -> list[Path]:
    return sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/**/*.py")])


def private_imports(path: Path, public: set[str]) -> list[str]:
    """`file:line: name` for each use of polyrl in `path` that goes around the public names: an import from a
    polyrl module, `from polyrl import` of a name not in `public`, `polyrl.<name>` off an imported `polyrl`,
    or `importlib.import_module("polyrl.<module>")`."""
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    package_names = set()  # what `import polyrl [as x]` binds
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "polyrl":
                found += [f"{rel}:{node.lineno}: polyrl.{a.name}" for a in node.names if a.name not in public]
            elif node.module.startswith("polyrl."):
                found += [f"{rel}:{node.lineno}: {node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "polyrl":
                    package_names.add(a.asname or a.name)
                elif a.name.startswith("polyrl."):
                    found.append(f"{rel}:{node.lineno}: {a.name}")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            target = node.args[0].value
            if name in ("import_module", "__import__") and isinstance(target, str) and target.startswith("polyrl."):
                found.append(f"{rel}:{node.lineno}: {target}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in package_names
                and node.attr not in public):
            found.append(f"{rel}:{node.lineno}: polyrl.{node.attr}")
    return found


def documented_names(text: str) -> list[str]:
    """The names each list entry of the API page opens with: "- `a`, `b`: what they are for"."""
    names = []
    for line in text.splitlines():
        if m := re.match(r"- ((?:`[^`]+`(?:, )?)+):", line):
            names += re.findall(r"`([^`]+)`", m.group(1))
    return names


def test_the_check_names_file_line_and_name_of_each_private_import(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text(
        "import importlib\n"
        "import polyrl\n"
        "from polyrl import build_run, rl_step\n"
        "def main():\n"
        "    from polyrl.train.step import produce_batch\n"
        "    from polyrl import _secret, rl_step\n"
        "    import polyrl.learner.forward_pass as fp\n"
        "    importlib.import_module('polyrl.engines.native')\n"
        "    return polyrl.build_run, polyrl.learner\n"
    )
    found = private_imports(script, {"build_run", "rl_step"})
    assert sorted(found) == sorted([
        f"{script}:5: polyrl.train.step.produce_batch",
        f"{script}:6: polyrl._secret",
        f"{script}:7: polyrl.learner.forward_pass",
        f"{script}:8: polyrl.engines.native",
        f"{script}:9: polyrl.learner",
    ])


def test_benchmarks_and_examples_import_only_public_names():
    found = {}
    for path in scripts():
        found[path.relative_to(ROOT).as_posix()] = private_imports(path, set(polyrl.PUBLIC))
    assert len(found) > 30 and "examples/grpo_in_one_file.py" in found  # the glob found the scripts
    bad = [line for lines in found.values() for line in lines]
    assert not bad, "imports of polyrl that are not in polyrl.PUBLIC (docs/api.md):\n" + "\n".join(bad)


def test_every_script_compiles():
    # compile, not only parse: errors of the symbol table (a name used before its `global`) pass ast.parse and ruff
    for path in scripts():
        compile(path.read_text(), str(path), "exec")


def test_every_public_name_is_on_the_api_page_and_nothing_else():
    documented = documented_names(API_PAGE.read_text())
    assert len(documented) == len(set(documented)), "a name listed twice on docs/api.md"
    missing = sorted(set(polyrl.PUBLIC) - set(documented))
    assert not missing, f"public names not on docs/api.md: {missing}"
    extra = sorted(set(documented) - set(polyrl.PUBLIC))
    assert not extra, f"names on docs/api.md that are not in polyrl.PUBLIC: {extra}"
    assert polyrl.__all__ == sorted(polyrl.PUBLIC)


def test_no_public_name_is_hidden_by_a_submodule():
    # `polyrl.rollout`, once imported, is the subpackage: a public name `rollout` would never be reached
    submodules = {m.name for m in pkgutil.iter_modules(polyrl.__path__)}
    assert {"train", "rollout", "config"} <= submodules
    assert not set(polyrl.PUBLIC) & submodules
    with pytest.raises(AttributeError, match="no attribute 'internal_thing'"):
        polyrl.internal_thing  # noqa: B018


def test_every_public_name_resolves_to_its_module_attribute():
    for name, target in polyrl.PUBLIC.items():
        module, _, attribute = target.partition(":")
        assert getattr(polyrl, name) is getattr(importlib.import_module(module), attribute or name), name


@pytest.mark.slow
def test_pass_costs_pick_the_layout_that_record_passes_lists():
    import torch

    from polyrl import Trajectory, collate, pass_costs, record_passes, token_logprobs
    from polyrl.learner import forward_pass
    from polyrl.models.loading import tiny_random_model

    def traj(prompt, response, group):
        return Trajectory(task="t", item_id=group, group_id=group, input_ids=prompt + response,
                          loss_mask=[0] * len(prompt) + [1] * len(response),
                          logprobs=[0.0] * (len(prompt) + len(response)), versions=[0] * (len(prompt) + len(response)))

    p1, p2 = [5, 6, 7, 8, 9], [11, 12, 13]  # answers of 9, 1, 2, 4, 2 and 6 tokens
    batch = collate([traj(p1, list(range(20, 29)), 0), traj(p1, [23], 0), traj(p1, [24, 25], 0),
                     traj(p2, [30, 31, 32, 33], 1), traj(p2, [34, 35], 1), traj(p2, list(range(36, 42)), 1)], 2)
    model = tiny_random_model(seed=3)
    defaults = forward_pass.BUCKET_OVERHEAD, forward_pass.PACKED_ATTENTION
    layouts, logps = {}, {}
    for name, costs in {"buckets": {"bucket_overhead": 0, "packed_attention": 0},
                        "one bucket": {"bucket_overhead": 10**9, "packed_attention": 0},
                        "packed": {"packed_attention": 10**9}}.items():
        with pass_costs(**costs), record_passes() as passes, torch.no_grad():
            logps[name], _ = token_logprobs(model, batch, temperature=0.7, bf16=False)
        layouts[name] = passes
    assert defaults == (forward_pass.BUCKET_OVERHEAD, forward_pass.PACKED_ATTENTION)  # restored after each block
    # the prompts once, then a bucket per answer length but the 1-token one (it needs no response pass)
    assert [p.layout for p in layouts["buckets"]] == ["prompts", "bucket", "bucket", "bucket", "bucket"]
    assert [p.layout for p in layouts["one bucket"]] == ["prompts", "bucket"]
    assert layouts["packed"] == [("packed", False)]
    mask = batch.loss_mask.bool()
    for name in ("one bucket", "packed"):
        assert torch.allclose(logps[name][mask], logps["buckets"][mask], atol=1e-5), name
    with record_passes() as passes:
        token_logprobs(model, batch, temperature=0.7, bf16=False)
    assert passes and all(p.with_grad for p in passes)
