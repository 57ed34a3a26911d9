"""A trial in inference mode: build a configuration, time it end to end, guard its outputs.

:class:`TrialContext` holds, for the whole study, the model, the validation samples and the
baseline's reference outputs; it also answers the calls made after the search: interleaved
rounds, the winner's export (:mod:`autotune.trial.artifacts`), the held-out score and the
diagnosis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from autotune._pristine import restore
from autotune.compress.fallback import Int8Plan
from autotune.config import Config, values_of
from autotune.errors import AutotuneError, InputError
from autotune.export.run_cache import model_digest
from autotune.export.scratch import run_file
from autotune.knobs.state import BuildState
from autotune.samples import call_model, to_device
from autotune.trial.artifacts import (  # noqa: F401  (re-exported: tests import them from here)
    ArtifactExport,
    _export_form,
    _label,
    _plain,
)
from autotune.trial.build import build
from autotune.trial.context import Context, compiles
from autotune.trial.extras import make_extras
from autotune.trial.faults import one_line
from autotune.trial.fidelity import attention_mask
from autotune.trial.guard import Reference, collect_outputs, collect_per_sample, evaluate, make_reference, per_sample
from autotune.trial.int8_guard import guard_value, keep_more_float
from autotune.trial.measure import (
    MeasureSettings,
    draw_seed,
    is_busy,
    measure,
    memory_mark,
    noise_reason,
    size_bytes,
)
from autotune.trial.phase import build_phase, say
from autotune.trial.spec import WorkerSpec

__all__ = ["TrialContext"]

_COLLATE_HINT = (
    "check that the model runs on a batch of any few samples of the dataset, not only of the first ones "
    "(with a collate_fn: on every batch it makes of them)"
)


@contextlib.contextmanager
def _step(doing: str, hint: str) -> Iterator[None]:
    """Turn an unexpected failure while setting a worker up into an :class:`InputError` that says,
    in one line, what failed and what to change; autotune's own errors pass as they are."""
    try:
        yield
    except AutotuneError:
        raise
    except Exception as exc:
        raise InputError(f"{doing} failed: {one_line(exc)}. To fix it, {hint}.") from exc


_WARMUP_KEYS = ("compile_s", "compile_cache_hits", "compile_cache_misses")
# With what each round's windows compiled, or ran eager past dynamo's limit: a round's figure
# must time the pipeline a user runs, not a compile.
# Timed windows per configuration in a selection or confirmation round: one, which ends where
# it began in a short epoch of unequal batches (whole epochs, see autotune.trial.epochs). A round
# is one ratio of the claim; the rounds' spread is its noise. The slow plain baseline of real
# MiniLM timed one epoch over two windows as over one, while its fast pick's second window made
# every round 0.4 s longer.
ROUND_WINDOWS = 1
_ROUND_KEYS = ("samples_per_s", "latency_ms_p50", "latency_ms_p95", "cov", "others_cpu", "peak_mem_mib", "recompiles",
               "compile_fallbacks")  # fmt: skip


class TrialContext(Context, ArtifactExport):
    """A worker's state in inference mode: the model, the data, the baseline's reference outputs."""

    def __init__(self, spec: WorkerSpec, checked: bool | dict[str, Any] = False) -> None:
        super().__init__(spec)
        self.model.eval()
        self._kept: list[tuple[dict[str, Any], BuildState]] = []  # the last rounds' builds (see prepare)
        self._guard_s = 0.0  # the last guard's seconds: what a stopped trial saves of it
        with _step("Collating the example and calibration batches", _COLLATE_HINT):
            self.extras = make_extras(self.spec, self.collate)
        self._reference: Reference | None = None
        # What an earlier worker learned of the baseline (see known), so builds read it without one.
        self._known = checked if isinstance(checked, dict) else {}
        self.extras.ragged = self._known.get("ragged", self.extras.ragged)
        self.extras.token_outputs = tuple(self._known.get("token_outputs", self.extras.token_outputs))
        self.info = {"n_params": sum(p.numel() for p in self.model.parameters()), "n_val": len(self.samples)}
        if not checked:
            # The run's first worker checks the model and the data before any trial: a model
            # that fails on them says so at the start, in one line.
            self.info["baseline_metric"] = self.reference.metric
            self.info["known"] = self.known()
            self.info["model_digest"] = model_digest(self.model)  # the key of the runs' history

    def _int8_plan(self, kinds: list[str] | None, budget_s: float) -> Int8Plan:
        """How this worker's int8 fallbacks judge: the guard's output ``kinds`` and criterion,
        ``budget_s`` seconds for a ranking, the study's rankings."""
        spec = self.spec
        return Int8Plan(kinds=kinds, max_drop=spec.max_metric_drop, metric=spec.metric, budget_s=budget_s,
                        rankings=dict(spec.int8_rankings), store=spec.int8_store, for_speed=not spec.sizes)  # fmt: skip

    def known(self) -> dict[str, Any]:
        """What this worker's reference taught it that a build reads (the guard's batches of
        images, the per-token outputs, how int8 fallbacks judge): a later worker of the run is
        started with it (:class:`~autotune.trial.runner.SubprocessRunner`), so a confirmation
        worker's int8 pick reads its model from the run's cache without running the baseline
        over the validation samples first (1.7 s of real MiniLM, in every such worker)."""
        plan = self.extras.int8
        return {
            "ragged": self.extras.ragged,
            "token_outputs": list(self.extras.token_outputs),
            "int8": None if plan is None else {"kinds": plan.kinds, "budget_s": plan.budget_s},
        }

    @property
    def reference(self) -> Reference:
        """The baseline's outputs and metric on the validation samples, made on first use.

        A later worker of the run (a confirmation's fresh process, a restart after a fault) is
        started ``checked``: the first worker checked the model and the data, and timing rounds
        never read the reference, so such a worker starts without it (a real MiniLM worker's
        start went from 9-12 s to 6.5 s). Making it also sets what the guard and the export read of the
        baseline (``extras.int8``, ``extras.ragged``, ``extras.token_outputs``).

        The first worker to make it stores it in the run's scratch folder, and such a later worker
        reads it there (an export after a selection ran the plain real MiniLM over its validation
        samples again: 1.7 s), with what the first worker learned of it (``checked``)."""
        if self._reference is not None:  # read on every trial: no file lookup once it is made
            return self._reference
        stored = run_file(f"reference-{str(self.spec.device).replace(':', '-')}.pt")
        if self._known and stored is not None:
            self._reference = Reference.load(stored, self.samples)
            if self._reference is not None and self.extras.int8 is None:
                known = self._known.get("int8") or {}
                self.extras.int8 = self._int8_plan(self._reference.kinds, known.get("budget_s", 10.0))
        if self._reference is None:
            spec, started = self.spec, time.perf_counter()
            with _step("Building the baseline", "check that the model can be deep-copied and moved to the device"):
                baseline = self._build(spec.baseline)
            self._probe(baseline)
            with _step("Running the baseline on the validation samples", _COLLATE_HINT):
                reference = make_reference(baseline, self.samples, spec.metric, spec.output_kind, spec.loss_fn)
            # int8_fallback ranks layers by the guard's own judgement, at most about two trials' time.
            one_trial = time.perf_counter() - started + spec.measure.n_windows * spec.measure.window_s
            self.extras.int8 = self._int8_plan(reference.kinds, max(10.0, 2 * one_trial))
            self._reference = reference
            if stored is not None:  # also over a file this worker could not read
                reference.save(stored)
        return self._reference

    def collate(self, samples: list[Any]) -> Any:
        """One batch of ``samples`` with the run's collate (as given: no trimming)."""
        from torch.utils.data import default_collate

        return (self.spec.collate_fn or default_collate)(samples)

    def _probe(self, state: BuildState) -> None:
        from autotune.samples import has_tensor

        try:
            batch = self.collate(self.samples[:2])
        except Exception as exc:
            raise InputError(f"collate_fn failed on the first two samples: {one_line(exc)}") from exc
        try:
            with torch.inference_mode():
                out = call_model(state.model, to_device(batch, torch.device(state.device)))
        except Exception as exc:
            raise InputError(f"The model's forward pass failed on the first batch: {one_line(exc)}") from exc
        if not has_tensor(out):
            raise InputError(
                f"The model's forward pass returned {_describe_output(out)}, with no tensor in it: there is nothing "
                "to compare or time. Return the model's outputs (a tensor, or a tuple, dict or dataclass of tensors)."
            )

    def build(self, config: dict[str, Any]) -> BuildState:
        """``config`` built on a fresh copy of the model, from stock process state."""
        if values_of(config).int8_fallback != 0 and self.extras.int8 is None:
            known = self._known.get("int8")
            if known is not None:  # judged as the first worker judged: its cached model is read
                self.extras.int8 = self._int8_plan(known["kinds"], known["budget_s"])
            else:
                self.reference  # noqa: B018 (made first: int8_fallback ranks layers against it)
        return self._build(config)

    def _build(self, config: dict[str, Any]) -> BuildState:
        """:meth:`build` without making the reference first (the reference's own baseline build)."""
        if compiles(config):  # its dynamo reset drops the compiled code of the builds kept
            self._kept = [(c, state) for c, state in self._kept if not compiles(c)]
        self.reset(config)
        return build(self.fresh_model(), Config(config), self.spec.device, extras=self.extras, copy_model=False)

    def trial(self, config: dict[str, Any], result: dict[str, Any]) -> None:
        """Build, measure and guard one configuration."""
        self.reference  # noqa: B018 (made first, in a worker started without it: its build is not the trial's)
        self._kept = []  # a compiled trial resets dynamo: what the rounds built is stale after it
        torch.manual_seed(self.spec.seed)
        mark = memory_mark(self.spec.device)  # before the build: the trial's memory is its own
        began = time.perf_counter()
        say(build_phase(config))
        state = self.build(config)
        # The build before the warm-up (the model's copy, a pruning, an export, a calibration):
        # what every later build of it costs again, in a confirmation's worker or the export.
        result["build_s"] = time.perf_counter() - began
        # Timing first: compilation lands in its warm-up (compile_s), and the numbers of a
        # candidate the guard rejects are still recorded.
        result.update(state.info)
        result.update(self._measure_clean(state, mark, draw_seed(self.spec.seed, "trial", config)))
        if torch.device(self.spec.device).type == "cuda" and not result["stopped"]:
            # The model alone on batches already on the device, beside the end to end: whether
            # the pipeline feeds the chip (input-, launch- or compute-bound).
            from autotune.trial.diagnose import model_alone

            try:
                result.update(model_alone(state, self.spec.dataset, result["samples_per_s"], self.spec.measure))
            except Exception as exc:  # the end-to-end figure stands without its explanation
                result["bound_error"] = one_line(exc)
        # A trial stopped early is no contender, its compressed size read by nothing: zlib would
        # take 3-4 s of its 1-2 s on a MiniLM's 90 MB of float weights (an OpenVINO float build's).
        # Nor is a contender's where no objective reads it (WorkerSpec.sizes).
        compress = not result["stopped"] and self.spec.sizes
        result["size_bytes"], result["size_bytes_compressed"] = size_bytes(state.model, state.artifact, compress)
        if result["stopped"]:
            # Far below the best so far after its first windows: neither more timing nor the
            # guard can make it a contender. What they would have cost is what was saved.
            result["fidelity_saved_s"] += self._guard_s
            result.update(
                status="stopped",
                kind="early-stop",
                reason=f"stopped after {result['n_windows']} of {self.spec.measure.n_windows} windows: "
                f"{result['samples_per_s']:,.0f} samples/s, under {self.spec.measure.stop_share:.0%} of the best so "
                f"far ({self.fidelity['best']:,.0f})",
            )
            return
        guard_start = time.perf_counter()
        say("checking the metric")
        value = guard_value(self, state)
        result["guard_s"] = self._guard_s = time.perf_counter() - guard_start
        result["metric"] = value
        result["metric_drop"] = self.reference.metric - value
        held = keep_more_float(self, config, result)
        if held is not None:  # int8 that the guard held only with more layers float: that build is the trial
            result.update(held.info)
            result.update(self._measure_clean(held, mark, draw_seed(self.spec.seed, "trial", config)))
            result["size_bytes"], result["size_bytes_compressed"] = size_bytes(
                held.model, held.artifact, self.spec.sizes
            )
            result["metric"] = value = guard_value(self, held)
            result["metric_drop"] = self.reference.metric - value

    def _measure_clean(self, state: BuildState, mark: float, seed: int) -> dict[str, Any]:
        """Measure ``state``; measure again (a bounded number of times, each on its own draw of
        batches) while the windows disagree or other processes used the CPU, keep the cleanest,
        and mark it ``noisy`` if none was clean.

        With a ``share`` in :attr:`fidelity` (a screening trial) fewer windows are timed; with
        the ``best`` samples/s so far, running under ``stop_share`` of it ends the
        measurement (``stopped``) and nothing is measured again. ``fidelity_saved_s`` is the
        timing this saved, in seconds."""
        full = self.spec.measure
        settings = full
        if self.fidelity.get("share"):
            short = max(2, math.ceil(full.n_windows * self.fidelity["share"]))
            settings = dataclasses.replace(full, n_windows=min(short, full.n_windows))
        leader = self.fidelity.get("best")
        stop_below = full.stop_share * leader if leader and full.stop_share > 0 else None
        best: dict[str, Any] | None = None
        for attempt in range(1 + settings.n_remeasure):
            restore(self.pristine)
            result = measure(
                state,
                self.spec.dataset,
                settings,
                mem_mark=mark if attempt == 0 else None,
                seed=seed + attempt,
                stop_below=stop_below if attempt == 0 else None,
            )
            # A window lasts about window_s, a little more: the windows not timed are what was saved.
            per_window = result["timed_s"] / max(1, result["n_windows"])
            result["fidelity_saved_s"] = (full.n_windows - result["n_windows"]) * per_window
            if result["stopped"]:
                result.update(noise=None, n_measurements=1, noisy=False, busy=is_busy(result, settings))
                return result
            result["noise"] = noise_reason(result, settings)
            if best is None or _noise_rank(result) < _noise_rank(best):
                # The build's warm-up (compile, cache reads) happened in the first measurement only.
                first = {k: best[k] for k in _WARMUP_KEYS} if best else {}
                best = {**result, **first}
                best["peak_mem_mib"] = max(best["peak_mem_mib"], result["peak_mem_mib"])
            if result["noise"] is None or _placed(result, leader, settings):
                break
            if self.fidelity.get("paired") and not is_busy(result, settings):
                break  # the baseline: timed again beside the pick, in the finish's rounds
        assert best is not None
        best["n_measurements"] = attempt + 1
        best["noisy"] = best["noise"] is not None
        best["busy"] = is_busy(best, settings)  # others' load, not merely windows that disagree
        return best

    def prepare(self, configs: list[dict[str, Any]]) -> list[BuildState]:
        # Builds are lazy (compilation happens in the first measurement), so building them all
        # first, each after a dynamo reset, is safe. Later rounds of the same configurations in
        # this worker (a confirmation in the selection's worker) time the builds the last rounds
        # made, warmed up: a compiled MiniLM pick's build and first warm-up took 8-9 s in each
        # call. Not where a new compiled build comes between: its dynamo reset drops their code.
        kept = {Config(c).key(): state for c, state in self._kept}
        if any(compiles(c) for c in configs if Config(c).key() not in kept):
            kept = {Config(c).key(): state for c, state in self._kept if not compiles(c)}
        states = [kept.get(Config(c).key()) or self.build(c) for c in configs]
        self._kept = list(zip(configs, states, strict=True))
        return states

    def time_round(
        self, prepared: BuildState, diagnose: bool, seed: int = 0, windows: int = 0, window_s: float = 0.0
    ) -> dict[str, Any]:
        # A round is one ratio of the claim's interval, which the rounds' spread makes honest:
        # its windows need not be a trial's. With five, a round of real MiniLM and its slow
        # baseline took about 18 s, and the five rounds a claim needs most of a run's finish.
        # A build's later rounds in this worker run warm: one batch before the clock where the
        # loader starts no workers, and no collection of the heap first (the plain baseline's
        # three batches and a collection were a second of each round of real MiniLM).
        warm = prepared.info.get("round_timed", False)
        workers = prepared.loader_kwargs.get("num_workers", 0) > 0
        spec = self.spec.measure
        n_warm = min(1, spec.warmup_batches) if warm and not workers else spec.warmup_batches
        n_windows = min(windows or ROUND_WINDOWS, spec.n_windows)
        settings = dataclasses.replace(spec, n_windows=n_windows, warmup_batches=n_warm,
                                       window_s=min(window_s or spec.window_s, spec.window_s))  # fmt: skip
        mark = memory_mark(prepared.device, collect=False) if warm else None
        m = measure(prepared, self.spec.dataset, settings, seed=seed, mem_mark=mark, clock_windows=True)
        prepared.info["round_timed"] = True
        row = {k: m[k] for k in _ROUND_KEYS}
        row["warmup_s"] = m["compile_s"]  # the build's compile, in its first round
        serial = m["model_s"] is not None and not workers
        if serial:  # the model's half of a diagnosis, from the rounds (see diagnose.model_from_rounds)
            row.update(model_s=m["model_s"], timed_samples=m["timed_samples"])
        if diagnose:
            restore(self.pristine)
            row.update(_halves(prepared, self.spec.dataset, settings, seed, loader_only=serial))
        return row

    def held_out(self, baseline: dict[str, Any], best: dict[str, Any]) -> dict[str, Any]:
        """The metric of the baseline and the winner on the held-out test samples."""
        reference = self.reference  # made first: it sets what collecting outputs reads (extras.ragged)
        samples = [self.spec.test_dataset[i] for i in range(len(self.spec.test_dataset))]
        states = [self.build(c) for c in (baseline, best)]
        if per_sample(states[0]):  # token sequences: outputs and mask per sample, on real tokens
            (ref, mask), (out, _) = (collect_per_sample(s, samples) for s in states)
            outputs = [ref, out]
        else:
            outputs, mask = [collect_outputs(s, samples) for s in states], attention_mask(samples)
        chunk, device, metric = reference.chunk, self.spec.device, self.spec.metric
        judge = {"kinds": reference.kinds, "mask": mask, "collate": self.extras.collate_fn}
        judge["tokens"] = self.extras.token_outputs
        base = evaluate(outputs[0], samples, chunk, device, metric, outputs[0], **judge)
        value = evaluate(outputs[1], samples, chunk, device, metric, outputs[0], **judge)
        return {"n_samples": len(samples), "baseline": base, "best": value, "drop": base - value}

    def diagnose(self, config: dict[str, Any]) -> dict[str, Any]:
        """Samples/s of ``config``'s loader alone and of its model alone (:mod:`autotune.trial.diagnose`)."""
        from autotune.trial.diagnose import diagnose_state

        torch.manual_seed(self.spec.seed)
        return diagnose_state(self.build(config), self.spec.dataset, self.spec.measure)

    def profile(self, config: dict[str, Any], trace: str) -> dict[str, Any]:
        """Where ``config``'s pipeline spends its time (:mod:`autotune.trial.profile`), its trace
        written to ``trace``."""
        from autotune.trial.profile import profile_state

        torch.manual_seed(self.spec.seed)
        # The build the last rounds timed, where they timed this configuration (see prepare).
        key = Config(config).key()
        state = next((s for c, s in self._kept if Config(c).key() == key), None) or self.build(config)
        return profile_state(state, self.spec.dataset, trace, seed=draw_seed(self.spec.seed, "profile"))


def _placed(result: dict[str, Any], leader: float | None, settings: Any) -> bool:
    """Whether a measurement whose windows disagree is placed anyway, on a quiet machine: even
    its fastest window ran under the ``leader`` (the best samples/s so far of its kind), or even
    its slowest one over it. Timing it again cannot move it past the leader either way: a
    pre-padded text run measured three trials far behind 3 times each, 85 s for one, and a first
    run of the Hugging Face pipeline its recipe (3.7x the baseline) and its OpenVINO int8 trial
    (its slowest window 14% over the best) 3 times each, 13 s. Only a busy machine's figure, or
    one whose windows straddle the leader, is worth another draw.

    Example:
        >>> from autotune.trial.measure import MeasureSettings
        >>> _placed({"samples_per_s_max": 160.0, "samples_per_s_min": 120.0, "cov": 0.09}, 258.0, MeasureSettings())
        True
        >>> _placed({"samples_per_s_max": 270.0, "samples_per_s_min": 230.0, "cov": 0.09}, 258.0, MeasureSettings())
        False
        >>> _placed({"samples_per_s_max": 950.0, "samples_per_s_min": 795.0, "cov": 0.06}, 698.0, MeasureSettings())
        True
    """
    if not leader or is_busy(result, settings):
        return False
    return result["samples_per_s_max"] < leader or result["samples_per_s_min"] > leader


def _noise_rank(result: dict[str, Any]) -> tuple[bool, float]:
    """Clean before noisy, then the steadier windows first."""
    return (result["noise"] is not None, result["cov"] + result["others_cpu"])


def _halves(
    state: BuildState, dataset: Any, settings: MeasureSettings, seed: int, loader_only: bool = False
) -> dict[str, float]:
    """The loader alone and the model alone of ``state``, timed for one short window each, right
    after a round ran its batches; with ``loader_only``, the loader alone (the model's half then
    comes from the rounds' own windows, :func:`~autotune.trial.diagnose.model_from_rounds`)."""
    from autotune.trial.diagnose import diagnose_state, loader_samples_per_s, window_for

    if loader_only:
        return {
            "loader_samples_per_s": loader_samples_per_s(
                dataset, state, window_for(settings), settings.warmup_batches, seed
            )
        }
    d = diagnose_state(state, dataset, settings, seed, warm=True)
    return {k: d[k] for k in ("loader_samples_per_s", "model_samples_per_s")}


def _describe_output(out: Any) -> str:
    if out is None:
        return "None"
    return f"a {type(out).__name__}"
