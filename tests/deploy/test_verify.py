"""`autotune verify` on real out dirs: a fresh run, tampered artifacts, a moved machine."""

import json
import shutil

import pytest
import torch

import autotune
from autotune.cli import main
from autotune.deploy.verify import env_diff, verify
from autotune.errors import ConfigError
from autotune.runtimes.artifacts import export_artifacts
from tests.models import Oracle, classification_data


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One real tuning run with both artifacts, shared read-only by the tests."""
    out = tmp_path_factory.mktemp("run") / "out"
    autotune.optimize(
        Oracle(),
        classification_data(),
        space={"base": None, "batch_size": [8, 32]},
        out_dir=out,
        device="cpu",
        n_trials=2,
        measure={"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
        n_verify_pairs=1,
        isolation="inprocess",
    )
    return out


@pytest.fixture
def copy(run_dir, tmp_path):
    """A copy of the run for a test that changes it."""
    return shutil.copytree(run_dir, tmp_path / "out")


def _edit_best(out, edit):
    path = out / "best_config.json"
    best = json.loads(path.read_text())
    edit(best)
    path.write_text(json.dumps(best))


def test_fresh_run_verifies_ok_with_tiny_errors(run_dir):
    report = verify(run_dir, n_batches=2)
    assert set(report["artifacts"]) == {"onnx", "torchscript"}
    for art in report["artifacts"].values():
        assert art["status"] == "ok", art["reason"]
        assert art["max_abs"] < 1e-4 and art["rel_l2"] < 1e-5 and art["fidelity"] > 0.9999
        assert art["samples_per_s"] > 0 and art["reason"] is None
    assert report["env_diff"] == []
    best = json.loads((run_dir / "best_config.json").read_text())
    assert report["recorded_samples_per_s"] == best["best"]["samples_per_s"]


def test_replaced_onnx_is_modified_and_cli_exits_1(copy, tmp_path, capsys, monkeypatch):
    other = torch.nn.Linear(16, 4, bias=False).eval()  # same signature, other weights
    export_artifacts(other, torch.randn(8, 16), [torch.randn(16)] * 8, 8, tmp_path / "other", ["onnx"])
    shutil.copy(tmp_path / "other" / "model.onnx", copy / "model.onnx")
    arts = verify(copy, n_batches=2)["artifacts"]
    assert arts["onnx"]["status"] == "modified"
    assert "sha256" in arts["onnx"]["reason"] and "differs from the tuned model" in arts["onnx"]["reason"]
    assert arts["onnx"]["fidelity"] < 1.0
    assert arts["torchscript"]["status"] == "ok"
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["verify", str(copy)]) == 1
    assert "modified" in capsys.readouterr().out


def test_flipped_bytes_are_modified(copy):
    data = bytearray((copy / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "model.pt").write_bytes(bytes(data))
    assert verify(copy, n_batches=2)["artifacts"]["torchscript"]["status"] == "modified"


def test_missing_file_and_failed_export_are_reported(copy):
    (copy / "model.pt").unlink()
    _edit_best(copy, lambda b: b["artifacts"]["onnx"].update(status="failed", error="parity: metric dropped"))
    arts = verify(copy, n_batches=2)["artifacts"]
    assert arts["torchscript"]["status"] == "missing"
    # Re-checked all the same, and its outputs still match; the export's verdict stands.
    assert arts["onnx"]["status"] == "failed" and arts["onnx"]["rel_l2"] < 1e-5
    assert "failed its checks at export (parity: metric dropped)" in arts["onnx"]["reason"]


def test_missing_directory_exits_2_with_one_line(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("autotune: error: No directory")


def test_missing_parity_file_is_a_config_error(copy):
    (copy / "parity.pt").unlink()
    with pytest.raises(ConfigError, match=r"No parity\.pt"):
        verify(copy)


def test_json_output_parses(run_dir, capsys):
    assert main(["verify", str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {a["status"] for a in report["artifacts"].values()} == {"ok"}
    assert report["env_diff"] == []


def test_env_diff_lists_what_changed(copy, capsys, monkeypatch):
    current = json.loads((copy / "best_config.json").read_text())["env"]["cpu_capability"]
    other = "AVX2" if current != "AVX2" else "AVX512"

    def edit(best):
        best["env"]["cpu_capability"] = other
        best["env"]["versions"]["torch"] = "1.0.0"

    _edit_best(copy, edit)
    diff = verify(copy, n_batches=2)["env_diff"]
    assert {"key": "cpu_capability", "recorded": other, "current": current} in diff
    assert [d["key"] for d in diff] == ["cpu_capability", "versions.torch"]
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["verify", str(copy)]) == 0  # a moved machine is reported, not a failure
    out = capsys.readouterr().out
    assert "changed since the search" in out and "1.0.0" in out and "same hardware" not in out


def test_env_diff_skips_versions_never_recorded():
    recorded = {"device": "cpu", "versions": {"torch": "2.0"}}
    current = {"device": "cpu", "versions": {"torch": "2.0", "onnxruntime": "1.20"}}
    assert env_diff(recorded, current) == []
    recorded["versions"]["onnxruntime"] = "1.19"
    assert env_diff(recorded, current) == [{"key": "versions.onnxruntime", "recorded": "1.19", "current": "1.20"}]


def test_numpy_samples_are_written_as_tensors_and_no_other_global_is_unpickled(copy):
    import datetime

    import numpy as np

    from autotune.trial.inference import _plain

    parity = torch.load(copy / "parity.pt", weights_only=True)
    plain = _plain([(x.numpy(), np.int64(y)) for x, y in parity["samples"]])
    assert isinstance(plain[0][0], torch.Tensor) and type(plain[0][1]) is int
    parity["samples"] = plain
    torch.save(parity, copy / "parity.pt")
    assert {a["status"] for a in verify(copy, n_batches=1)["artifacts"].values()} == {"ok"}
    # Unpickling anything else, numpy's globals included, could run code: refused.
    for sample in (datetime.date(2020, 1, 1), np.zeros(3)):
        torch.save({"samples": [sample], "outputs": parity["outputs"]}, copy / "parity.pt")
        with pytest.raises(ConfigError, match="holds objects other than tensors"):
            verify(copy)


class _RunsCode:
    """Unpickles to a call of numpy's own exec wrapper: a numpy global that is code execution."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        from numpy.testing._private.utils import runstring

        return runstring, (f"open({self.marker!r}, 'w').write('pwned')", {})


def test_verify_does_not_unpickle_a_tampered_parity_file(copy, tmp_path):
    marker = tmp_path / "pwned"
    data = torch.load(copy / "parity.pt", weights_only=True)
    data["samples"] = [_RunsCode(marker), *data["samples"]]
    torch.save(data, copy / "parity.pt")
    with pytest.raises(ConfigError, match="could run any code"):
        verify(copy)
    assert not marker.exists()


@pytest.mark.parametrize("escape", ["../outside.onnx", "/etc/passwd"])
def test_load_refuses_an_artifact_path_outside_the_run(copy, escape):
    shutil.copy(copy / "model.onnx", copy.parent / "outside.onnx")

    def point_out(best):
        best["artifacts"]["onnx"]["path"] = escape

    _edit_best(copy, point_out)
    with pytest.raises(ConfigError, match="leaves"):
        autotune.load(copy, format="onnx")


def test_load_refuses_a_changed_artifact_unless_allowed(copy):
    with open(copy / "model.pt", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ConfigError, match="sha256"):
        autotune.load(copy, format="torchscript")
    with pytest.warns(UserWarning, match="changed since export"):
        assert autotune.load(copy, format="torchscript", allow_modified=True).format == "torchscript"
    assert verify(copy)["artifacts"]["torchscript"]["status"] == "modified"


def test_load_serves_the_fastest_artifact_that_passed_and_says_which(run_dir):
    predict = autotune.load(run_dir)
    assert predict.format in ("onnx", "torchscript")
    assert "fastest here" in predict.chosen and "onnx" in predict.chosen and "torchscript" in predict.chosen


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without CUDA")
def test_a_cuda_run_is_verified_on_the_cpu_here_with_a_warning(copy):
    def on_cuda(best):
        best["env"]["device"] = "cuda:0"

    _edit_best(copy, on_cuda)
    with pytest.warns(UserWarning, match="tuned on 'cuda:0', which this machine lacks"):
        report = verify(copy, n_batches=2)
    assert report["device"] == "cpu"
    assert {"key": "device", "recorded": "cuda:0", "current": "cpu"} in report["env_diff"]
    assert all(art["status"] == "ok" for art in report["artifacts"].values())
