"""``optimize`` and ``plan``: the run's entry points. ``optimize`` is its options checked into one
:class:`~autotune.run.options.Options` and the stages of :mod:`autotune.run.stages`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.run.plan import plan

if TYPE_CHECKING:
    from autotune.record import Result

__all__ = ["optimize", "plan"]


def optimize(
    model: Any,
    dataset: Any,
    *,
    mode: str = "inference",
    space: str | Path | Mapping[str, Any] = "default",
    metric: Callable[[Any, Any], float] | None = None,
    max_metric_drop: float = 0.01,
    objectives: Sequence[str] | str | None = None,
    n_trials: int | None = None,
    timeout: float | None = None,
    device: str = "auto",
    out_dir: str | Path = "autotune-out",
    storage: str | None = None,
    study_name: str | None = None,
    resume: bool = False,
    join: bool = False,
    devices: Sequence[int | str] | str | None = None,
    heartbeat_interval_s: int = 30,
    grace_period_s: int = 180,
    fix: Mapping[str, Any] | None = None,
    seed: int = 0,
    baseline_batch_size: int | None = None,
    trial_timeout: float | None = None,
    isolation: str = "subprocess",
    n_val: int = 512,
    measure: Mapping[str, Any] | None = None,
    n_verify_pairs: int = 4,
    n_finalists: int = 3,
    select: Any = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    train_dataset: Any = None,
    prune_ignore: Sequence[str] = (),
    test_dataset: Any = None,
    export: Sequence[str] | None = None,
    sampler: Any = None,
    strategy: str = "staged",
    optimizer: Any = None,
    effective_batch_size: int | None = None,
    allow_batch_change: bool = False,
    loss_tolerance: float = 0.05,
    n_train_steps: int = 20,
    progress: bool | Callable[[dict[str, Any], int, int], None] | None = True,
    output_kind: Any = "auto",
    collate_fn: Callable[[list[Any]], Any] | None = None,
    pad_values: Mapping[str, int] | None = None,
    profile: bool = True,
    repeated_passes: bool = False,
    budget: float | str | None = None,
) -> Result:
    """Search for the fastest configuration of ``model`` on ``dataset`` whose accuracy holds.

    Args:
        model: An ``nn.Module`` or a zero-argument function returning one.
        dataset: A map-style dataset or sequence of samples (or a function returning one), or
            the ``torch.utils.data.DataLoader`` you use now: its dataset, ``collate_fn``, batch
            size and workers are the baseline.
        mode: ``"inference"`` (tune the forward pass) or ``"train"`` (tune the training step:
            needs ``loss_fn`` and ``optimizer``; see docs/training.md).
        space: Preset name (``autotune spaces`` lists them), a TOML file, or a dict of knob
            values on top of a preset (see :func:`autotune.search.space.resolve_space`).
        metric: ``metric(outputs, batch) -> float``, higher is better; without it, fidelity to
            the baseline's outputs is the metric.
        max_metric_drop: Largest allowed drop of the metric below the baseline's (absolute).
            For fidelity it applies to each output by its kind: see ``output_kind``.
        objectives: What to optimize, any of ``throughput`` (max), ``latency`` (p95, min),
            ``size`` (compressed bytes, min), ``memory`` (peak, min) and ``metric`` (max); default
            the preset's own (``shrink`` declares size and latency), else ``("throughput",)``.
        n_trials: Measured trials in the study (a resumed study counts its earlier ones); default
            30. Given none of ``n_trials``, ``timeout`` and ``budget``, the run also has a
            ``budget`` of 10 minutes: it ends at 30 trials or within 10 minutes, whichever comes
            first, and its first lines say so.
        timeout: Seconds for the whole call, counted from its start; ``None`` for no limit. The
            search ends a quarter of it (20 to 90 s, at most half) before the deadline, a trial
            still running then is stopped; the rounds that confirm the winner and the held-out
            scoring end at the deadline; the export may run past it by 10% of ``timeout`` (30 s
            at least), then writing the result files. With ``isolation="inprocess"`` work is
            interrupted between Python steps, so a native call that hangs is not.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        out_dir: Directory of the result files.
        storage: Optuna storage URL; default ``sqlite:///<out_dir>/study.db``.
        study_name: Default ``"autotune"``.
        resume: Continue an existing study instead of refusing to touch it.
        join: Share the study with other workers (other processes, other machines) that run
            it now or later: created by whichever comes first, joined by the rest; the budget
            ``n_trials`` counts every worker's trials. See docs/scaling.md.
        devices: One worker per listed device of this machine, sharing the study: GPU indices
            (``[0, 1, 2, 3]``, each worker pinned to its GPU) or ``"cpu"`` repeated (parallel CPU
            workers compete for cores: for smoke tests, not for honest CPU timings).
        heartbeat_interval_s: Seconds between heartbeats of a running trial in the storage.
        grace_period_s: Seconds without a heartbeat after which a trial's worker is taken for
            dead: its trial is marked failed and its configuration retried once.
        fix: Knobs pinned to one value, e.g. ``dict(amp_dtype="bfloat16")``.
        seed: Seeds the sampler and torch.
        baseline_batch_size: Batch size of the baseline (your current one); default the
            DataLoader's, else 32.
        trial_timeout: Seconds one trial may take before its worker is killed; ``None`` (the
            default) adapts it: 10 times the baseline trial's wall time, at least 30 s, plus
            120 s for a configuration that compiles, quantizes, prunes or changes the runtime.
            A trial still running at the ``timeout`` deadline is stopped then.
        isolation: ``"subprocess"`` (a worker process, restarted after faults) or ``"inprocess"``
            (no protection from crashes; timeouts interrupt the work with an alarm).
        n_val: Samples in the fixed validation subset of the guard.
        measure: Timing settings: ``n_windows``, ``window_s``, ``warmup_batches``, the noise
            limits ``max_cov`` (0.05), ``max_others_cpu`` (0.10) and ``n_remeasure`` (2; 1 under a ``budget`` or ``timeout``), and
            ``stop_share`` (0.75: a trial whose first windows run under that share of the best so
            far stops early; 0 times every trial fully); see
            :class:`autotune.trial.measure.MeasureSettings`.
        n_verify_pairs: Interleaved rounds that choose among the finalists, and the least number
            of fresh confirmation rounds of the chosen one against the baseline (they continue,
            up to three times as many, until the speedup's 95% interval is within +-5%): 4, two
            in each of the two fresh worker processes.
        n_finalists: Best trials re-measured against the baseline before the winner is chosen:
            one measurement per trial can flatter a configuration by chance. Only trials within 8%
            of the fastest are re-measured.
        select: With several objectives, which member of the feasible Pareto front wins: an
            objective name, or a function of the front's records returning one; default the
            highest throughput.
        loss_fn: ``loss_fn(outputs, batch) -> Tensor``; enables recovery fine-tuning of pruned
            candidates (the ``finetune_steps`` knob).
        train_dataset: Samples for fine-tuning (default: the samples of ``dataset`` outside the
            validation subset, which then holds at most half of them).
        prune_ignore: Module names (as in ``named_modules()``) that pruning keeps whole.
        test_dataset: Held-out samples: the baseline's and the winner's metric on them is
            reported (``held_out`` in ``best_config.json``), never used to choose.
        export: Artifacts of the winner to write, each with its parity check: ``"onnx"``
            (``model.onnx``), ``"torchscript"`` (``model.pt``); ``()`` for none. Default both
            in inference mode, none in training mode.
        sampler: An Optuna sampler to use instead of the seeded TPE sampler.
        strategy: ``"staged"`` (the default): the levers the data and device vouch for
            (trimmed padding, padded image sizes, 16-bit autocast, a larger batch) measured
            together and built on when they pay, each other lever (compile, int8, threads, ...;
            with size first, int8 and pruning) measured alone, those that paid composed, then
            TPE; values screening measured clearly slower are left out
            (:mod:`autotune.search.strategy`). ``"tpe"``: TPE after a warm start.
        progress: ``True`` (the default) shows the search on stderr: a live display on a
            terminal, one plain line per trial anywhere else (a log file, a pipe, a notebook),
            each naming the knobs that differ from the baseline; a resumed run first says how
            many trials it kept. ``False`` shows nothing. A function is called after each trial
            with (trial record, trials measured, n_trials) instead.
        optimizer: Training mode: an optimizer class (``torch.optim.AdamW``), a pair
            ``(class, kwargs)`` or a function ``params -> optimizer``; its hyper-parameters are
            never tuned, only its implementation (``optimizer_impl``).
        effective_batch_size: Training mode: samples per optimizer step, kept by gradient
            accumulation over micro-batches (``batch_size``); default ``baseline_batch_size``.
        allow_batch_change: Training mode: let the effective batch size follow ``batch_size``
            (one micro-batch per step); the loss guard still applies.
        loss_tolerance: Training mode without a ``metric``: largest relative change of the final
            mean loss after ``n_train_steps`` steps from the same start, against the baseline's.
        n_train_steps: Training mode: optimizer steps (at the baseline's effective batch) each
            trial trains before timing; their losses are the guard.
        output_kind: How fidelity (no ``metric``) judges the outputs: ``"auto"``, ``"logits"``,
            ``"embedding"`` or ``"integer"`` for every output, a list in output order or a dict
            by output name. ``"auto"`` takes logits only on strong evidence (integer targets,
            a cross-entropy ``loss_fn``). See docs/concepts.md.
        collate_fn: ``collate_fn(samples) -> batch`` for samples ``default_collate`` cannot
            batch (token sequences of different lengths, say), as in your DataLoader. Without
            one, dict samples of 1-D token sequences with an ``attention_mask`` (or with
            ``pad_values``) are padded to each batch's longest. See docs/text.md.
        pad_values: The pad id of each token-sequence input (``{"input_ids": 0}``) for the
            automatic padding collate; the attention mask always pads with 0.
        profile: Profile the baseline and the winner after the timed rounds, each for a second
            or two (``torch.profiler``): ``trace-baseline.json.gz``, ``trace-best.json.gz`` and
            the report's operator breakdown. ``False`` skips it. See docs/report.md.
        budget: The wall time the whole run may take, from the call to the report: seconds or a
            duration (``"5m"``, ``"90s"``, ``"1h30m"``). Unlike ``timeout`` (the hard stop), the
            run plans its finish from measured costs (worker starts, builds, rounds, export),
            stops searching when that time is due, and ends within 10% of it with the best
            passing candidate confirmed; a budget too small to confirm anything says so before
            the first trial. With both, the shorter one holds.
        repeated_passes: The same samples are read again and again in use (repeated evaluation
            of a fixed set), as epochs do in training: only then can a cache of decoded samples
            (``cache_decoded``) pay, so in inference it is offered only with ``True``, and a
            winner that caches says so in its claim.

    Returns:
        A :class:`Result`.

    Example:
        >>> import torch, autotune
        >>> data = [(torch.randn(16), 0) for _ in range(256)]
        >>> result = autotune.optimize(torch.nn.Linear(16, 4), data, space="quick", n_trials=3,
        ...                            out_dir="/tmp/autotune-doc")  # doctest: +SKIP
    """
    options = {k: v for k, v in locals().items() if k not in ("model", "dataset")}
    import contextlib
    import time

    started = time.monotonic()  # a budget or timeout counts from the call

    from autotune.run.options import Options
    from autotune.run.progress import display
    from autotune.run.stages import execute

    opts = Options(**{**options, "progress": None})  # checked before the display starts
    opts = opts.replace(progress=display(progress, timeout=opts.limit_s, n_trials=opts.n_trials))
    shown = opts.progress if hasattr(opts.progress, "__enter__") else contextlib.nullcontext()
    with shown:
        result = execute(model, dataset, opts, started)
    from autotune.run.hints import space_note

    result.notes.extend(filter(None, [space_note(opts)]))
    return result
