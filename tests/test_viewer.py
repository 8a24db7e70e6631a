"""The rollout viewer: its JSON API over a real smoke run, and the page end-to-end in headless Chromium.

The browser tests need Debian's ``chromium`` and the ``playwright`` package (dev extra; it drives the system
browser, nothing is downloaded). ``scripts/test.sh`` installs Chromium when it is missing (as root) or stops with
how to; their absence here is a failure, never a skip.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import SMOKE

from polyrl.observe.viewer import RunIndex, ViewerError, check_host, make_server, token_texts

CHROMIUM = os.environ.get("POLYRL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PER_GROUP = 2


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, polyrl_cli):
    out = tmp_path_factory.mktemp("viewer") / "run"
    res = polyrl_cli.run(["train", str(SMOKE), "--output", str(out), f"logging.trajectories_per_group={PER_GROUP}",
                          "logging.tensorboard=false", "logging.report=false", "train.checkpoint_every=0",
                          "eval.before=false", "eval.after=false"])  # forked (conftest)
    assert res.returncode == 0, res.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from polyrl.models.loading import load_tokenizer

    return load_tokenizer("tiny-random")


class Served:
    def __init__(self, run_dir):
        self.server = make_server(run_dir, "127.0.0.1", 0)  # port 0: a free port, no race
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = self.server.url

    def get(self, path):
        try:
            with urllib.request.urlopen(self.url + path.lstrip("/"), timeout=30) as res:
                return res.status, json.loads(res.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def served(smoke_run):
    s = Served(smoke_run)
    yield s
    s.close()


@pytest.mark.slow
def test_api_lists_and_decodes_a_real_run(served, smoke_run, tokenizer):
    status, listing = served.get("/api/trajectories")
    rows = listing["rows"]
    assert status == 200 and len(rows) == 2 * 2 * PER_GROUP  # steps x prompts x stored per group
    assert {r["step"] for r in rows} == {1, 2} and {r["task"] for r in rows} == {"chain_sum"}

    status, tr = served.get("/api/trajectory/3")
    assert status == 200 and tr["i"] == 3
    ids = tr["input_ids"]
    # Per-token text joins back to exactly the decoded interaction.
    assert "".join(tr["token_text"]) == tokenizer.decode(ids, skip_special_tokens=False)
    assert tr["prompt_len"] == tr["loss_mask"].index(1)
    assert tr["special"][0] is (ids[0] in tokenizer.all_special_ids)
    assert len(tr["group"]) == PER_GROUP and tr["i"] in [g["i"] for g in tr["group"]]
    assert all(g["step"] == tr["step"] and g["group_id"] == tr["group_id"] for g in tr["group"])
    # the step's engine/learner mismatch beside the sample, as logged in metrics.jsonl for that step
    logged = [json.loads(x) for x in (smoke_run / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in logged if r["step"] == tr["step"])
    assert tr["step_metrics"] and tr["step_metrics"] == {k: v for k, v in row.items() if k.startswith("mismatch/")
                                                          or k.startswith("staleness/") or k.startswith("off_policy/")}

    status, run = served.get("/api/run")
    assert run["model"] == "tiny-random" and run["summary"]["steps"] == 2 and "name: smoke" in run["config"]
    assert served.get("/api/trajectory/999")[0] == 404
    assert served.get("/api/trajectory/x")[0] == 400
    assert served.get("/static/../config.yaml")[0] == 404


def test_token_texts_keep_multibyte_characters(tokenizer):
    text = "Größe: 5 € — 東京 🙂 done"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    pieces = token_texts(tokenizer, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_only_loopback_hosts():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_host(host)
    for host in ("0.0.0.0", "192.168.1.5", "example.org"):
        with pytest.raises(ViewerError, match="loopback"):
            check_host(host)


def test_bad_row_names_file_and_line(tmp_path):
    (tmp_path / "trajectories.jsonl").write_text('{"input_ids": [1], "step": 1}\n{oops\n')
    with pytest.raises(ViewerError, match=r"trajectories\.jsonl:2: not valid JSON"):
        RunIndex(tmp_path)
    with pytest.raises(ViewerError, match="no such run directory"):
        RunIndex(tmp_path / "nope")


def test_index_follows_a_growing_file(tmp_path):
    path = tmp_path / "trajectories.jsonl"
    row = {"step": 1, "task": "t", "group_id": 0, "input_ids": [1, 2], "loss_mask": [0, 1], "text": "hi"}
    path.write_text(json.dumps(row) + "\n" + json.dumps(row)[:10])  # second line still being written
    index = RunIndex(tmp_path)
    assert len(index.rows) == 1
    with open(path, "a") as f:
        f.write(json.dumps(row)[10:] + "\n")
    index.refresh()
    assert len(index.rows) == 2 and index.record(1)["text"] == "hi"


@pytest.mark.slow
def test_cli_view_serves_and_refuses_public_hosts(smoke_run, polyrl_cli):
    res = polyrl_cli.run(["view", str(smoke_run), "--host", "0.0.0.0"], timeout=60)
    assert res.returncode == 2 and "loopback" in res.stderr and "Traceback" not in res.stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "polyrl", "view", str(smoke_run), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        url = line.split(" at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url, timeout=30) as res:
            assert b'id="traj-table"' in res.read()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ------------------------------------------------------------------------------------------ browser


def _require_browser():
    problem = None
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        problem = f"{CHROMIUM} not found (apt-get install -y chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            problem = "the playwright package is not installed (pip install -e '.[dev]')"
    if problem:  # scripts/test.sh installs Chromium or stops first; run directly, this fails rather than skips
        pytest.fail(f"the browser test cannot run: {problem}")


@pytest.fixture(scope="module")
def browser_page(tmp_path_factory):
    _require_browser()
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")  # a fresh user-data-dir
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 900},
        )
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.errors = errors
        yield page
        context.close()


def _rows(page):
    return page.locator("#traj-table tbody tr")


@pytest.mark.slow
def test_page_filters_and_opens_a_trajectory(browser_page, served, smoke_run, tmp_path):
    page = browser_page
    page.goto(served.url)
    page.wait_for_selector("#traj-table tbody tr")
    assert _rows(page).count() == 8
    assert page.inner_text("#run-name") == smoke_run.name
    assert "model tiny-random" in page.inner_text("#run-meta")

    page.fill("#f-step-min", "2")
    assert _rows(page).count() == 4
    assert set(page.locator("#traj-table tbody tr td:first-child").all_inner_texts()) == {"2"}
    page.select_option("#f-terminated_early", "yes")  # nothing terminated early in this run
    assert _rows(page).count() == 0 and "no trajectories match" in page.inner_text("#count")
    page.click("#f-reset")
    assert _rows(page).count() == 8
    page.fill("#f-rmin", "2")  # rewards are in [0, 1]
    assert _rows(page).count() == 0
    page.click("#f-reset")
    page.select_option("#f-task", "chain_sum")
    page.select_option("#f-truncated", "yes")
    truncated = sum(1 for r in served.server.index.rows if r["truncated"])
    assert _rows(page).count() == truncated

    page.click("#f-reset")
    _rows(page).nth(5).click()
    page.wait_for_selector("#tokens .tok.model")
    _, tr = served.get("/api/trajectory/5")
    assert "step 2" in page.inner_text("#detail-title") and page.url.endswith("#t=5")
    assert "mismatch/kl" in page.inner_text("#step-metrics")  # the step's engine/learner mismatch
    assert page.locator("#tokens .tok.prompt").count() == tr["prompt_len"]
    assert page.locator("#tokens .tok.model").count() == sum(tr["loss_mask"])
    assert page.locator("#tokens .tok").evaluate_all(
        "els => els.map(e => e.textContent).join('')"
    ) == "".join(tr["token_text"])
    title = page.locator("#tokens .tok.model").first.get_attribute("title")
    assert "in loss" in title and "log-prob" in title
    assert page.locator("#group-table tbody tr").count() == PER_GROUP
    assert page.locator("#group-table tbody tr.current").count() == 1
    assert page.inner_text("#plain-text") == tr["text"]
    page.uncheck("#show-mask")
    assert "hide-mask" in page.get_attribute("#tokens", "class")
    page.check("#show-mask")
    page.screenshot(path=str(tmp_path / "viewer.png"), full_page=True)
    assert (tmp_path / "viewer.png").stat().st_size > 10_000
    assert page.errors == []


def _branching_run(path: Path) -> Path:
    """A multi-turn run with an ARPO-style tree: a root and two branches, env tokens between turns."""
    path.mkdir()
    (path / "config.yaml").write_text("name: arpo\nmodel:\n  name: tiny-random\n")
    prompt, turn1, env, turn2 = [1, 4093, 198, 30], [520, 9531, 198], [1, 28120, 198, 38, 2], [3403, 2988, 2]
    ids = prompt + turn1 + env + turn2
    a, b = len(prompt), len(prompt) + len(turn1) + len(env)
    base = {
        "step": 3,
        "task": "tool_math",
        "item_id": 7,
        "group_id": 0,
        "input_ids": ids,
        "loss_mask": [0] * a + [1] * len(turn1) + [0] * len(env) + [1] * len(turn2),
        "logprobs": [0.0] * a + [-0.1, -2.5, -7.0] + [0.0] * len(env) + [-0.5, -1.0, -0.01],
        "versions": [-1] * a + [2] * len(turn1) + [-1] * len(env) + [3] * len(turn2),
        "turn_spans": [[a, a + len(turn1)], [b, b + len(turn2)]],
        "text": "two turns",
        "rewards": {"ok": 1.0},
        "truncated": False,
        "terminated_early": False,
        "replayed": False,
    }
    rows = [
        {**base, "reward": 1.0, "advantage": 0.5, "info": {"branch_id": "r", "branch_at": a}},
        {
            **base,
            "reward": 0.0,
            "advantage": -0.5,
            "info": {"branch_id": "r.1", "parent_id": "r", "branch_at": b},
        },
        {
            **base,
            "reward": 1.0,
            "advantage": 0.5,
            "replayed": True,
            "info": {"branch_id": "r.1.1", "parent_id": "r.1", "branch_at": b + 1},
        },
    ]
    (path / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_page_shows_turns_env_tokens_and_branch_tree(browser_page, tmp_path):
    page = browser_page
    srv = Served(_branching_run(tmp_path / "arpo"))
    try:
        page.goto(srv.url + "#t=1")
        page.wait_for_selector("#tokens .tok.model")
        assert page.locator("#tokens .turn-mark").count() == 2
        assert page.locator("#tokens .tok.env").count() == 5
        assert page.locator("#tokens .tok.model").count() == 6
        assert "branched here from r" in page.inner_text("#tokens .branch-mark")
        tree = page.locator("ul.branch-tree")
        assert tree.locator("li").count() == 3
        assert tree.locator("li li li").count() == 1  # r -> r.1 -> r.1.1
        assert "r.1 @" in tree.locator("li.current > a").inner_text()
        page.select_option("#f-replayed", "yes")
        assert _rows(page).count() == 1
        page.screenshot(path=str(tmp_path / "viewer-arpo.png"), full_page=True)
        assert page.errors == []
    finally:
        srv.close()


@pytest.mark.slow
def test_page_filters_by_reward_hacking_monitor(browser_page, tmp_path):
    """The monitor filter (polyrl/rewards/monitors.py flags in info.monitor_flags): any flag, none, one flag."""
    run = tmp_path / "monitored"
    run.mkdir()
    (run / "config.yaml").write_text("name: monitored\nmodel:\n  name: tiny-random\n")
    base = {"step": 1, "task": "he", "item_id": 0, "group_id": 0, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1],
            "logprobs": [0.0, -0.1, -0.2], "versions": [-1, 0, 0], "text": "def f(x): ...", "reward": 1.0}
    flags = [[], ["early_exit"], ["equality_override", "writes_outside"], []]
    rows = [{**base, "item_id": i, "info": {"monitor_flags": f}} for i, f in enumerate(flags)]
    rows.append({**base, "item_id": 9, "task": "other", "info": {}})  # a task the monitors do not check
    (run / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = Served(run)
    try:
        _, listing = s.get("/api/trajectories")
        assert [r["monitor_flags"] for r in listing["rows"]] == [*flags, []]
        page = browser_page
        page.goto(s.url)
        page.wait_for_selector("#traj-table tbody tr")
        assert _rows(page).count() == 5
        page.select_option("#f-monitor", "flagged")
        assert _rows(page).count() == 2
        assert "early exit" in page.inner_text("#traj-table tbody")
        page.select_option("#f-monitor", "writes_outside")
        assert _rows(page).count() == 1
        page.select_option("#f-monitor", "clean")
        assert _rows(page).count() == 3
        page.click("#f-reset")
        assert _rows(page).count() == 5
        assert page.errors == []
    finally:
        s.close()
