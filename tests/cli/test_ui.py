"""`infernet ui` (issue 27): the read-only page of a running network, its token, and the page as a real browser
renders it (headless Chromium, Debian's package: peers listed, the job's state, the chart's points per round).
The checks run on the network of tests/cli/test_job_flow.py once its job is DONE (``check_the_ui``). Without
Chromium the browser half is left out with a warning naming it; `make ui-check` keeps the screenshot."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest

from tests.cli.conftest import REPO, cli

pytestmark = pytest.mark.network

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _get(url: str, token: str | None = None, method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(url, method=method, headers={"X-Infernet-Token": token} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _post(url: str, body: dict, token: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **({"X-Infernet-Token": token} if token else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def check_the_ui(tmp_path: Path, home: str, job: dict) -> None:
    """The UI of a network whose 2-round job ``job`` is DONE (tests/cli/test_job_flow.py runs that network: a network
    of agent processes of its own here took 30-40 s of the suite for the same job)."""
    ui = subprocess.Popen([sys.executable, "-m", "agent.cli", "ui", "--home", home], stdout=subprocess.PIPE, text=True,
                          cwd=REPO, env=dict(os.environ))
    try:
        line = ui.stdout.readline()
        match = re.search(r"(http://127\.0\.0\.1:(\d+)/)\?token=(\S+)", line)
        assert match, line
        base, token = match.group(1), match.group(3)
        # the token is the key: none or another is 403, the static files need none, nothing is written
        assert _get(base)[0] == 403 and _get(base + "?token=wrong")[0] == 403
        assert _get(base + "api/jobs")[0] == 403 and _get(base + "api/jobs", token="x" * len(token))[0] == 403
        status, page = _get(base + "?token=" + token)
        assert status == 200 and b'<div id="val-chart"' in page
        assert _get(base + "static/uPlot.iife.min.js")[0] == 200
        assert _get(base + "api/jobs", token=token, method="PUT")[0] == 405
        assert _get(base + "api/jobs/not-hex", token=token)[0] == 404
        status, body = _get(base + "api/jobs/" + job["id"], token=token)
        detail = json.loads(body)
        assert status == 200 and detail["state"] == "DONE" and len(detail["aggregates"]) == 2
        status, body = _get(base + "api/peers", token=token)
        peers = json.loads(body)
        assert status == 200 and len(peers) >= 2
        # the quick-inference box: the job's last aggregate on its base, and the base alone; the token as a header only
        infer = base + f"api/jobs/{job['id']}/infer"
        assert _post(infer, {"prompt": "hi"})[0] == 403 and _post(infer + "?token=" + token, {"prompt": "hi"})[0] == 403
        assert _post(infer, {"prompt": ""}, token)[0] == 400
        status, body = _post(infer, {"prompt": "What is 3 plus 4?"}, token)
        answer = json.loads(body)
        assert status == 200 and isinstance(answer["answer"], str) and isinstance(answer["base_answer"], str), answer
        status, body = _get(base + f"api/jobs/{job['id']}/prompts", token=token)
        assert status == 200 and json.loads(body)["prompts"]  # from the job's validation split

        browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
        if browser is None:
            warnings.warn(f"no headless browser here ({', '.join(BROWSERS)}): the UI page's rendering was not checked")
            return
        url = f"{base}?token={token}&job={job['id']}"
        flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--virtual-time-budget=8000", "--window-size=1280,1300"]
        dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
        assert 'data-ready="1"' in dom, dom[:2000]
        assert re.search(r'<div id="val-chart" data-points="2">.*?<canvas', dom, re.S), "two rounds on the chart"
        assert re.search(r'<div id="train-chart" data-series="[1-9]', dom), "training curves drawn"
        assert dom.count("data-peer=") >= 2 and f'data-job="{job["id"]}"' in dom
        assert re.search(r'<td class="DONE">DONE</td>', dom)
        assert re.search(r'<form id="infer">', dom) and "<button" in dom.split('id="suggestions"')[1][:400]
        shots = Path(os.environ.get("INFERNET_UI_SHOTS") or tmp_path)
        shots.mkdir(parents=True, exist_ok=True)
        subprocess.run(flags + [f"--screenshot={shots / 'job-view.png'}", url], capture_output=True, timeout=120)
        assert (shots / "job-view.png").stat().st_size > 10_000
    finally:
        ui.terminate()
        ui.wait(timeout=30)


def test_ui_without_an_agent_is_one_line(tmp_path):
    from tests.cli.conftest import assert_one_line_error

    assert_one_line_error(cli("ui", "--home", str(tmp_path / "nobody")), "agent")
