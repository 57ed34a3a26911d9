"""The finish exports a pick known before its rounds (the only finalist, no deadline) first, in
the search's worker, which holds the baseline's reference; a pick the rounds do not keep has its
files replaced by the winner's."""

import json

import autotune
from tests.models import MLP, classification_data

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0}


def _optimize(out, **kw):
    return autotune.optimize(
        MLP(),
        classification_data(512),
        space={"base": None, "batch_size": [8, 128]},
        device="cpu",
        out_dir=out,
        n_trials=2,
        n_finalists=1,
        measure=FAST,
        n_verify_pairs=2,
        export=("torchscript", "onnx"),
        profile=False,
        **kw,
    )


def test_the_only_finalist_is_exported_before_its_confirmation_rounds(tmp_path):
    _optimize(tmp_path)
    best = json.loads((tmp_path / "best_config.json").read_text())
    phases = [p["phase"] for p in best["finish"]]
    # Exported once, unless the rounds did not keep the pick (a busy machine): then the winner too.
    kept = best["config"]["batch_size"] == 128
    assert phases[:2] == ["export", "confirmation"] and phases.count("export") == (1 if kept else 2), phases
    assert {a["status"] for a in best["artifacts"].values()} == {"ok"}
    assert {a["status"] for a in autotune.verify(tmp_path)["artifacts"].values()} == {"ok"}


def test_a_pick_the_rounds_do_not_keep_has_its_files_replaced_by_the_winners(tmp_path, monkeypatch):
    """The confirmation may find no measurable speedup: the baseline then stands, and what was
    exported of the pick before the rounds must not stay behind as the run's files."""
    import autotune.run.rounds as result

    real = result.claim_speedup

    def baseline_stands(runner, baseline, finalists, *a, **k):
        _, confirmed, table = real(runner, baseline, finalists, *a, **k)
        return baseline, confirmed, table  # as a confirmation that found nothing measurable

    monkeypatch.setattr(result, "claim_speedup", baseline_stands)
    _optimize(tmp_path)
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert [p["phase"] for p in best["finish"]].count("export") == 2
    assert best["artifacts"]["torchscript"]["status"] == "ok"
    assert best["config"] == best["baseline_config"]
    assert {a["status"] for a in autotune.verify(tmp_path)["artifacts"].values()} == {"ok"}
    sizes = {a["batch_size"] for a in best["artifacts"].values()}
    assert sizes == {best["baseline_config"]["batch_size"]} and 128 not in sizes  # the baseline's files


def test_an_export_that_no_longer_stands_leaves_none_of_its_files(tmp_path):
    """An OpenVINO pick's IR (model.xml, model.bin) would stay beside the baseline's TorchScript
    and ONNX files, which the baseline's export writes without it."""
    from autotune.run.finish import _drop_files

    names = ["model.xml", "model.bin", "model.pt", "parity.pt", "report.md"]
    for name in names:
        (tmp_path / name).write_text("x")
    _drop_files(
        tmp_path, {"openvino": {"path": "model.xml", "bin_path": "model.bin"}, "torchscript": {"path": "model.pt"}}
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]
