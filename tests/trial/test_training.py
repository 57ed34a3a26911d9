"""Training mode: short studies on a CNN and an MLP, gradient accumulation, the loss-curve guard,
optimizer implementations and the ``autotune.training`` pieces in a user's own loop."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import autotune
from autotune.errors import ConfigError, TrialError
from autotune.trial.train_setup import FixedOrder, optimizer_factory, prepare, with_impl
from tests.models import MLP, SmallCNN, classification_data

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0}


def _digits() -> list:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).div_(16.0).unsqueeze(1)  # (1797, 1, 8, 8)
    y = torch.tensor(digits.target, dtype=torch.int64) % 4  # SmallCNN has 4 classes
    return list(zip(x[:512], y[:512], strict=True))


def _cross_entropy(outputs: torch.Tensor, batch: tuple) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


def _trials(out) -> list[dict]:
    import optuna

    study = optuna.load_study(study_name="autotune", storage=f"sqlite:///{out / 'study.db'}")
    return [t.user_attrs for t in study.trials]


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_cnn_study_in_worker_processes(tmp_path):
    result = autotune.optimize(
        SmallCNN(),
        _digits(),
        mode="train",
        loss_fn=_cross_entropy,
        optimizer=(torch.optim.AdamW, {"lr": 3e-3}),
        space={"base": None, "batch_size": [8, 16, 32], "optimizer_impl": "all", "amp_dtype": "all"},
        n_trials=4,
        n_train_steps=10,
        measure=FAST,
        n_verify_pairs=2,
        out_dir=tmp_path,
    )
    saved = json.loads((tmp_path / "best_config.json").read_text())
    assert saved["mode"] == "train" and saved["guard"] == {"metric": "loss_curve", "loss_tolerance": 0.05}
    assert saved["train"]["effective_batch_size"] == 32 and saved["train"]["optimizer"].startswith("AdamW(")
    assert saved["artifacts"] == {}  # training mode exports nothing
    trials = [t for t in _trials(tmp_path) if t.get("ran")]
    assert len(trials) == 4 and all(t["status"] in ("ok", "infeasible") for t in trials)
    for t in trials:
        # Same samples per step for every micro-batch: accumulation makes up the difference.
        assert t["effective_batch_size"] == 32
        assert t["accumulation_steps"] * t["config"]["batch_size"] == 32
        assert t["samples_per_s"] > 0 and t["loss_final"] < t["loss_first"]  # it learned
    baseline = trials[0]
    assert baseline["baseline"] and baseline["loss_rel_change"] == 0.0
    assert result.best["effective_batch_size"] == 32 and result.speedup > 0


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_mlp_study_in_process(tmp_path):
    data = classification_data(n=512)
    result = autotune.optimize(
        MLP(),
        data,
        mode="train",
        loss_fn=_cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        space="quick",
        n_trials=4,
        n_train_steps=8,
        measure=FAST,
        n_verify_pairs=2,
        isolation="inprocess",
        out_dir=tmp_path,
    )
    ran = [t for t in _trials(tmp_path) if t.get("ran")]
    assert len(ran) == 4
    assert {t["config"]["batch_size"] for t in ran} <= {8, 16, 32}  # divisors of the effective 32
    assert all(t["config"]["quantization"] == "none" and t["config"]["prune_ratio"] == 0.0 for t in ran)
    assert set(result.best_config) >= {"optimizer_impl", "batch_size"}
    rows = (tmp_path / "trials.csv").read_text().splitlines()
    assert "loss_final" in rows[0] and "accumulation_steps" in rows[0]


def test_accumulated_gradient_equals_the_large_batch_gradient():
    # SGD with lr=1 and no momentum: one step moves each weight by exactly minus its gradient,
    # so equal updates mean equal gradients.
    data = classification_data(n=64)
    updates = {}
    for micro in (8, 32):
        setup = prepare(
            MLP(),
            {"batch_size": micro},
            "cpu",
            optimizer_factory((torch.optim.SGD, {"lr": 1.0})),
            data,
            effective_batch_size=32,
            sampler=FixedOrder(len(data), 32, seed=0),
        )
        before = [p.detach().clone() for p in setup.model.parameters()]
        setup.step(iter(setup.loader), _cross_entropy)
        updates[micro] = [p.detach() - b for p, b in zip(setup.model.parameters(), before, strict=True)]
        assert setup.accumulation_steps == 32 // micro
    for small, large in zip(updates[8], updates[32], strict=True):
        assert small.abs().max() > 0
        torch.testing.assert_close(small, large, rtol=1e-5, atol=1e-6)


class _NormalisedLoss:
    """Standardises the logits over the batch: at a micro-batch of one the standard deviation is
    zero and the loss NaN, a real way for a batch size to break learning."""

    def __call__(self, outputs: torch.Tensor, batch: tuple) -> torch.Tensor:
        z = (outputs - outputs.mean(0)) / outputs.std(0)
        return nn.functional.cross_entropy(z, batch[1])


@pytest.mark.filterwarnings("ignore:std:UserWarning")
def test_a_value_that_makes_the_loss_nan_is_infeasible(tmp_path):
    autotune.optimize(
        MLP(),
        classification_data(n=256),
        mode="train",
        loss_fn=_NormalisedLoss(),
        optimizer=(torch.optim.SGD, {"lr": 0.05}),
        space={"base": None, "batch_size": [1, 32]},
        n_trials=2,
        n_train_steps=4,
        measure=FAST,
        isolation="inprocess",
        out_dir=tmp_path,
    )
    by_batch = {t["config"]["batch_size"]: t for t in _trials(tmp_path) if t.get("ran")}
    assert by_batch[32]["status"] == "ok"
    assert by_batch[1]["status"] == "infeasible" and by_batch[1]["kind"] == "nan"
    assert "NaN" in by_batch[1]["reason"]


def test_a_changed_effective_batch_that_learns_differently_fails_the_guard(tmp_path):
    # With the effective batch free, batch 128 takes a quarter of the steps over the same
    # samples at the same learning rate: its loss ends far above the baseline's.
    autotune.optimize(
        MLP(),
        classification_data(n=512),
        mode="train",
        loss_fn=_cross_entropy,
        optimizer=(torch.optim.SGD, {"lr": 0.1}),
        space={"base": None, "batch_size": [32, 128]},
        allow_batch_change=True,
        n_trials=2,
        n_train_steps=16,
        measure=FAST,
        isolation="inprocess",
        out_dir=tmp_path,
    )
    by_batch = {t["config"]["batch_size"]: t for t in _trials(tmp_path) if t.get("ran")}
    big = by_batch[128]
    assert big["effective_batch_size"] == 128 and big["accumulation_steps"] == 1
    assert big["status"] == "infeasible" and big["kind"] == "guard"
    assert big["loss_rel_change"] > 0.05 and "tolerance" in big["reason"]


def test_optimizer_implementations_keep_hyper_parameters_and_updates():
    data = classification_data(n=64)
    updated = {}
    for impl in ("default", "foreach", "fused"):
        setup = prepare(
            MLP(),
            {"batch_size": 16, "optimizer_impl": impl},
            "cpu",
            optimizer_factory((torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})),
            data,
            sampler=FixedOrder(len(data), 16, seed=0),
        )
        group = setup.optimizer.param_groups[0]
        assert (group["lr"], group["weight_decay"]) == (1e-2, 0.1)
        assert group["fused"] is (True if impl == "fused" else group["fused"])
        assert group["foreach"] is (True if impl == "foreach" else group["foreach"])
        batches = iter(setup.loader)
        for _ in range(3):
            setup.step(batches, _cross_entropy)
        updated[impl] = [p.detach().clone() for p in setup.model.parameters()]
    for impl in ("foreach", "fused"):
        for a, b in zip(updated["default"], updated[impl], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_an_optimizer_without_the_implementation_is_unsupported():
    opt = torch.optim.RMSprop(MLP().parameters(), lr=0.01)
    with pytest.raises(TrialError, match="RMSprop has no fused implementation") as info:
        with_impl(opt, "fused")
    assert info.value.kind == "unsupported"


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_training_pieces_run_a_user_loop(tmp_path):
    data = _digits()
    optimizer = (torch.optim.AdamW, {"lr": 3e-3})
    autotune.optimize(
        SmallCNN(),
        data,
        mode="train",
        loss_fn=_cross_entropy,
        optimizer=optimizer,
        space={"base": None, "batch_size": [16, 32], "amp_dtype": "all"},
        effective_batch_size=32,
        n_trials=2,
        n_train_steps=4,
        measure=FAST,
        isolation="inprocess",
        out_dir=tmp_path,
    )
    t = autotune.training(SmallCNN(), optimizer, data, tmp_path, device="cpu")
    assert t.effective_batch_size == 32 and t.accumulation_steps * t.batch_size == 32
    # The loop a user writes, with the pieces:
    losses = []
    for _epoch in range(3):
        total = 0.0
        for i, batch in enumerate(t.loader):
            x, y = t.to_device(batch)
            with t.autocast():
                loss = nn.functional.cross_entropy(t.model(x), y) / t.accumulation_steps
            t.scaler.scale(loss).backward()
            if (i + 1) % t.accumulation_steps == 0:
                t.scaler.step(t.optimizer)
                t.scaler.update()
                t.optimizer.zero_grad(set_to_none=True)
            total += loss.item()
        losses.append(total)
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"optimizer": (torch.optim.SGD, {"lr": 0.1})}, "needs `loss_fn"),
        ({"loss_fn": _cross_entropy}, "needs `optimizer`"),
        ({"loss_fn": _cross_entropy, "optimizer": torch.optim.SGD(MLP().parameters(), lr=0.1)}, "instance"),
        ({"loss_fn": _cross_entropy, "optimizer": torch.optim.SGD, "export": ("onnx",)}, "exports nothing"),
        ({"loss_fn": _cross_entropy, "optimizer": torch.optim.SGD, "objectives": ("size",)}, "size"),
        ({"loss_fn": _cross_entropy, "optimizer": torch.optim.SGD, "effective_batch_size": 12_800}, "larger than"),
        ({"loss_fn": _cross_entropy, "optimizer": torch.optim.SGD, "loss_tolerance": 2}, "loss_tolerance"),
        ({"loss_fn": _cross_entropy, "optimizer": torch.optim.SGD, "effective_batch_size": "64"}, "positive integer"),
        ({"loss_fn": _cross_entropy, "optimizer": torch.optim.SGD, "effective_batch_size": 48}, "not a multiple"),
        ({"loss_fn": _cross_entropy, "optimizer": torch.optim.SGD, "objectives": ("metric",)}, "needs a `metric`"),
        ({"loss_fn": _cross_entropy, "optimizer": torch.optim.SGD, "train_dataset": [0]}, "not `train_dataset`"),
    ],
)
def test_training_options_are_checked_before_anything_runs(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        autotune.optimize(MLP(), classification_data(n=64), mode="train", out_dir=tmp_path, **options)


def test_training_space_keeps_inference_knobs_off_and_micro_batches_dividing(cpu_env):
    # The effective batch defaults to the baseline batch (32), as in optimize.
    _, _, space = autotune.plan(MLP(), classification_data(n=256), mode="train")
    assert sorted(space.values["batch_size"]) == [8, 16, 32]
    assert "does not divide the effective batch size 32" in space.excluded["batch_size"]["64"]
    assert space.values["optimizer_impl"] == ["default", "foreach", "fused"]
    _, _, free = autotune.plan(MLP(), classification_data(n=256), mode="train", allow_batch_change=True)
    assert 64 in free.values["batch_size"]
    _, _, shrink = autotune.plan(MLP(), classification_data(n=256), mode="train", space={"base": "shrink"})
    assert shrink.values["quantization"] == ["none"]
    assert "only used in inference mode" in shrink.excluded["quantization"]["int8_dynamic"]
    _, _, inference = autotune.plan(MLP(), classification_data(n=256))
    assert inference.values["optimizer_impl"] == ["default"]
    assert "only used in train mode" in inference.excluded["optimizer_impl"]["fused"]


@pytest.mark.slow
def test_compiled_training_step_learns_like_eager(tmp_path):
    autotune.optimize(
        SmallCNN(),
        _digits(),
        mode="train",
        loss_fn=_cross_entropy,
        optimizer=(torch.optim.AdamW, {"lr": 3e-3}),
        space={"base": None, "compile_mode": ["none", "default"]},
        n_trials=2,
        n_train_steps=10,
        measure=FAST,
        isolation="inprocess",
        out_dir=tmp_path,
    )
    by_mode = {t["config"]["compile_mode"]: t for t in _trials(tmp_path) if t.get("ran")}
    assert by_mode["default"]["status"] == "ok"
    assert abs(by_mode["default"]["loss_rel_change"]) < 0.01


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cuda_float16_with_gradient_scaler_learns_like_float32(tmp_path):
    # 60 steps: the scaler may skip a step or two while its scale settles, a lag that 20 steps
    # (3% of loss a step there) would read as a different curve, and 60 (under 1%) do not.
    autotune.optimize(
        SmallCNN(),
        _digits(),
        mode="train",
        device="cuda",
        loss_fn=_cross_entropy,
        optimizer=(torch.optim.AdamW, {"lr": 3e-3}),
        space={"base": None, "amp_dtype": ["float32", "float16"]},
        n_trials=2,
        n_train_steps=60,
        measure=FAST,
        out_dir=tmp_path,
        trial_timeout=120,
    )
    by_dtype = {t["config"]["amp_dtype"]: t for t in _trials(tmp_path) if t.get("ran")}
    fp32, fp16 = by_dtype["float32"], by_dtype["float16"]
    assert fp16["status"] == "ok", fp16.get("reason")
    assert fp16["skipped_steps"] <= 3  # the scaler settles; no overflow storm
    for run in (fp32, fp16):
        assert run["loss_final"] < 0.8 * run["loss_first"]  # both learn
    assert abs(fp16["loss_rel_change"]) <= 0.05  # to the same level
    assert fp16["loss_final"] != fp32["loss_final"]  # float16 really ran: not the float32 curve bit for bit


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(600)  # two compiles of the forward and backward in the worker
def test_cuda_fused_adamw_compiled_step_and_pinned_memory(tmp_path):
    optimizer = (torch.optim.AdamW, {"lr": 3e-3})
    autotune.optimize(
        SmallCNN(),
        _digits(),
        mode="train",
        device="cuda",
        loss_fn=_cross_entropy,
        optimizer=optimizer,
        space={"base": None, "optimizer_impl": ["default", "fused"]},
        fix={"compile_mode": "default", "pin_memory": True, "num_workers": 2},
        n_trials=3,  # the baseline and both implementations under the fixed settings
        n_train_steps=10,
        measure=FAST,
        out_dir=tmp_path,
        timeout=480,  # the run, a hung compile included, ends before the test's limit
        trial_timeout=240,
    )
    ran = [t for t in _trials(tmp_path) if t.get("ran")]
    fused = next(t for t in ran if t["config"]["optimizer_impl"] == "fused")
    assert fused["status"] == "ok", fused.get("reason")
    assert fused["config"]["compile_mode"] == "default" and fused["config"]["pin_memory"] is True
    assert abs(fused["loss_rel_change"]) < 0.05
    # The same configuration in a user's loop: a fused AdamW, a compiled model, pinned batches
    # from two loader workers.
    setup = autotune.training(SmallCNN(), optimizer, _digits(), fused["config"], device="cuda")
    assert setup.optimizer.defaults["fused"] is True
    assert getattr(setup.model, "_orig_mod", None) is not None  # what torch.compile returns
    images, _ = next(iter(setup.loader))
    assert images.is_pinned() and setup.loader.num_workers == 2
