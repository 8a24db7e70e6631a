"""Config errors are one line that names the file and key."""

import re

import pytest
import yaml
from conftest import SMOKE

from polyrl.config import ConfigError
from polyrl.config_check import load_config


def _error(tmp_path, data=None, overrides=(), source=None):
    path = tmp_path / "exp.yaml"
    base = yaml.safe_load(SMOKE.read_text())
    path.write_text(yaml.safe_dump(data if data is not None else base))
    with pytest.raises(ConfigError) as exc:
        load_config(path, list(overrides))
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(source or str(path))
    return msg


def test_smoke_and_quickstart_load():
    cfg = load_config(SMOKE, ["optim.lr=3e-4", "tasks.0.eval_size=5"])
    assert cfg.optim.lr == 3e-4 and cfg.tasks[0].eval_size == 5
    assert load_config(SMOKE.parent / "quickstart.yaml").model.name == "smollm2-135m-instruct"


@pytest.mark.parametrize("path", sorted(SMOKE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_its_names_check(path):
    """A shipped config with a misspelt key, task, param or stage task fails here, not in a user's first run."""
    cfg = load_config(path)
    names = {task.name for task in cfg.tasks}
    assert cfg.tasks and all(set(stage.tasks or ()) <= names for stage in cfg.stages)


def test_unknown_key_is_named(tmp_path):
    assert "optim.lrr: unknown key" in _error(tmp_path, overrides=["optim.lrr=1"])


def test_wrong_type_is_named(tmp_path):
    msg = _error(tmp_path, overrides=["rollout.group_size=eight"])
    assert "rollout.group_size" in msg and "integer" in msg


def test_out_of_range_value_is_named(tmp_path):
    assert "rollout.temperature" in _error(tmp_path, overrides=["rollout.temperature=-1"])


def test_unknown_task_lists_valid_ones(tmp_path):
    msg = _error(tmp_path, overrides=["tasks.0.name=chain_summ"])
    assert "tasks.0.name: unknown task 'chain_summ'" in msg and "chain_sum," in msg


def test_bad_task_params_are_named_when_the_config_loads(tmp_path):
    msg = _error(tmp_path, overrides=["tasks.0.params={min_term: 2}"])
    assert "tasks.0.params" in msg and "min_term" in msg
    crossed = "tasks.0.params={min_terms: 5, max_terms: 2}"
    assert "max_terms must be >= min_terms" in _error(tmp_path, overrides=[crossed])
    assert "tasks.0.params.seed: set by polyrl" in _error(tmp_path, overrides=["tasks.0.params={seed: 1}"])


def test_unknown_algorithm_lists_valid_ones(tmp_path):
    msg = _error(tmp_path, overrides=["algorithm.loss=ppo_clipp"])
    assert "algorithm.loss" in msg and "ppo_clip" in msg


def test_missing_tasks_and_bad_yaml(tmp_path):
    assert "tasks: required key is missing" in _error(tmp_path, data={"name": "x"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


def test_override_syntax_errors_name_the_override(tmp_path):
    assert "expected key=value" in _error(tmp_path, overrides=["optim.lr"], source="override 'optim.lr'")
    assert "tasks.5" in _error(tmp_path, overrides=["tasks.5.name=x"], source="override 'tasks.5.name'")


def test_broken_chat_template_is_one_line(tmp_path):
    import shutil

    from polyrl.models.loading import load_tokenizer, smollm2_tokenizer_dir

    model_dir = tmp_path / "model"
    shutil.copytree(smollm2_tokenizer_dir(), model_dir)
    (model_dir / "config.json").write_text("{}")
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")  # unclosed tag
    for stale in model_dir.glob("tokenizer_config.json"):
        data = stale.read_text().replace('"chat_template"', '"_unused_chat_template"')
        stale.write_text(data)
    with pytest.raises(ValueError, match=r"^model '.*': its chat template does not render") as exc:
        load_tokenizer(str(model_dir))
    assert "\n" not in str(exc.value)


def test_a_missing_optional_package_fails_when_the_config_loads(monkeypatch):
    """ray is looked for before anything loads; the error is one line with the install command."""
    import polyrl.config_check as config_check

    monkeypatch.setattr(config_check, "find_spec", lambda name: None)
    data = {"model": {"name": "tiny-random"}, "tasks": [{"name": "chain_sum"}], "runtime": {"kind": "ray"}}
    with pytest.raises(ConfigError, match=re.escape("runtime.kind: ray is not installed; pip install 'polyrl[ray]'")) \
            as err:
        config_check.load_config(None, data=data)
    assert "\n" not in str(err.value)


def test_vllm_refuses_features_that_end_or_read_rows_while_sampling(tmp_path, monkeypatch):
    """vLLM has no per-step hook: agent tasks, early termination and ARPO are refused at load, in one line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hook_agent.py").write_text("async def run(client, item):\n    return 1.0\n")
    base = {"model": {"name": "tiny-random"}, "tasks": [{"name": "chain_sum"}], "engine": {"kind": "vllm"}}
    agent = {"tasks": [{"name": "chain_sum"}, {"name": "a", "agent": "hook_agent:run", "items": [{}]}]}
    cases = [(agent, "tasks.1.agent: agent tasks need engine.kind: hf"),
             ({"agents": {"early_stop": {"enabled": True}}}, "agents.early_stop: needs engine.kind: hf"),
             ({"agents": {"arpo": {"enabled": True}}}, "agents.arpo: needs engine.kind: hf")]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)) as err:
            load_config(None, data={**base, **extra})
        assert "\n" not in str(err.value)
        assert load_config(None, data={**base, **extra, "engine": {"kind": "hf"}}).engine.kind == "hf"
    assert load_config(None, data=base).engine.kind == "vllm"
