"""`autotune dashboard OUT_DIR`: the run's storage in optuna-dashboard, or what to install."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

from autotune.cli import main
from autotune.report.dashboard import dashboard_storage


def test_without_the_extra_the_error_says_what_to_install(finished_run, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "optuna_dashboard", None)  # what an absent package looks like to import
    assert main(["dashboard", str(finished_run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install "torch-autotune[dashboard]"' in err


def test_the_storage_is_the_one_the_run_recorded(finished_run):
    best = json.loads((finished_run / "best_config.json").read_text())
    assert dashboard_storage(finished_run) == best["study"]["storage"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_dashboard_serves_the_study(finished_run):
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "autotune", "dashboard", str(finished_run), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline, studies = time.monotonic() + 30, None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=2) as reply:
                    studies = json.loads(reply.read())
                break
            except OSError:
                time.sleep(0.2)
        assert studies is not None, server.stdout.read().decode() if server.poll() is not None else "no answer"
        assert [s["study_name"] for s in studies["study_summaries"]] == ["autotune"]
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_recorded_storage_without_its_password_asks_for_the_url(tmp_path, capsys):
    study = {"name": "autotune", "storage": "postgresql://tuner:***@db.example:5432/studies"}
    (tmp_path / "best_config.json").write_text(json.dumps({"study": study}))
    assert main(["dashboard", str(tmp_path)]) == 2
    assert "--storage URL" in capsys.readouterr().err
