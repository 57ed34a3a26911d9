"""``predictor`` and ``predict``: a tuned model applied once, run over samples through the tuned
loader, outputs put back in dataset order.

What a run's claim timed is the tuned model fed by the tuned DataLoader (:func:`~autotune.apply`
plus :func:`~autotune.dataloader`); a :class:`Predictor` runs that same pipeline, building the
model once and ordering the outputs once per call.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from autotune.errors import ConfigError

__all__ = ["Predictor", "predict", "predictor"]


class Predictor:
    """A model tuned once, called on datasets: every sample's output, in dataset order.

    Build one with :func:`predictor`. Each call reads the samples through the tuned DataLoader
    (the batch size, workers, padding and length grouping of :func:`~autotune.dataloader`),
    runs the tuned model and returns one output per sample, without a batch axis; a token-level
    output (one row per position) keeps the sample's real tokens only.

    A compiled model compiles per batch shape (or once, with ``compile_dynamic``); :meth:`warm`
    runs one batch of each shape the tuned loader makes, so a call's time is the pipeline's,
    as the run timed it after its own warm-up. Where dynamo stops compiling new shapes (its
    recompile limit), a one-line warning says that their batches run eager.

    Attributes:
        model: The tuned model (what :func:`~autotune.apply` returned).
        config: The configuration it was built with.
        device: Where it runs.
        build_s: Seconds building the tuned model took here (0.0 when this process had built it
            already, or it was given built).
        compile_s: Seconds :meth:`warm` took: the compiles (as trials report ``compile_s``).
        n_compiles: Graphs torch.compile compiled during calls, after the warm-up: shapes it
            had not seen (another dataset's).
    """

    def __init__(
        self, model: Any, config: Any, device: str, collate_fn: Any = None, pad_values: Mapping[str, int] | None = None
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.collate_fn = collate_fn
        self.pad_values = pad_values
        self.build_s = 0.0
        self.compile_s = 0.0
        self.n_compiles = 0
        self._warned = False
        # The last dataset, its loader, and its order as a list and inverted (batching.inverse_order).
        self._cached: tuple[Any, Any, list[int], Any] | None = None
        self._sizes: tuple[Any, list[tuple[int, int]]] | None = None  # images: the last dataset's sizes

    def _loader(self, dataset: Any, collate_fn: Any) -> tuple[Any, list[int], Any]:
        """The tuned loader over ``dataset``, its order and the order inverted (the last
        dataset's again, if it is)."""
        from autotune.batching.outputs import inverse_order
        from autotune.run.apply import dataloader

        if self._cached is not None and self._cached[0] is dataset:
            # The same samples again: the same loader (its persistent workers stay up) and order.
            return self._cached[1], self._cached[2], self._cached[3]
        # Another predictor of this build read these samples last (predict's calls each make
        # one): its loader and order again. Made afresh, they were a tenth of a pass of real
        # MiniLM text (the lengths read twice, a batch of each shape collated for the warm-up).
        kept, how = _kept(self.model), (self.config.key(), collate_fn, dict(self.pad_values or {}), self.device)
        last = kept.get(_LOADER)
        same = last is not None and last["dataset"] is dataset and len(last["order"]) == len(dataset)
        if same and last["how"][1] is collate_fn and last["how"] == how:
            self._cached = (dataset, last["loader"], last["order"], last["inverse"])
            return self._cached[1], self._cached[2], self._cached[3]
        # On the model's device, as the trials fed it: the prefetcher's copies, the samples kept there.
        loader = dataloader(dataset, self.config, collate_fn=collate_fn, pad_values=self.pad_values, device=self.device)
        order = [i for ids in loader.batch_sampler for i in ids]
        self._cached = (dataset, loader, order, inverse_order(order))
        # One dataset kept per build, as a predictor keeps one: the last one read.
        kept[_LOADER] = {"dataset": dataset, "how": how, "loader": loader, "order": order, "inverse": self._cached[3],
                         "warmed": False}  # fmt: skip
        return loader, order, self._cached[3]

    def warm(self, dataset: Any) -> float:
        """Run the model once on each batch shape the tuned loader makes of ``dataset`` (for
        token sequences: each batch size and longest sample), so that a compiled model compiles
        them here and not inside a call. Shapes this model ran already are skipped.

        Returns:
            The seconds it took, also added to :attr:`compile_s`.
        """
        import time

        import torch

        from autotune.batching import lengths_of
        from autotune.data import describe
        from autotune.run.apply import _unloaded
        from autotune.samples import call_model, collector_frozen, to_device
        from autotune.trial.warmup import compile_counts, shape_batches, signature

        dataset, collate_fn = _unloaded(dataset, self.collate_fn)
        loader = self._loader(dataset, collate_fn)[0]
        if loader.collate_fn is not None and _pads_images(loader.collate_fn):
            return 0.0  # images of many sizes: their shapes are not told apart here
        last = _kept(self.model).get(_LOADER)
        if last is not None and last["loader"] is loader and last["warmed"]:
            return 0.0  # this build ran every shape of these samples' batches already
        started, before = time.perf_counter(), compile_counts()
        sequence = describe(dataset, collate_fn, self.pad_values).sequence is not None
        # Kept on the model: every predictor of one build (predict's calls) skips what it ran.
        done = getattr(self.model, "__dict__", {}).setdefault("_autotune_shapes", set())
        where = torch.device(self.device)
        with torch.inference_mode(), collector_frozen():
            for batch in shape_batches(loader, lengths_of(dataset) if sequence else None):
                mark = signature(batch)
                if mark not in done:
                    call_model(self.model, to_device(batch, where) if where.type != "cpu" else batch)
                    done.add(mark)
        self._compiled(before, counted=False)
        if last is not None and last["loader"] is loader:
            last["warmed"] = True
        spent = time.perf_counter() - started
        self.compile_s += spent
        return spent

    def _compiled(self, before: tuple[int, int], counted: bool = True) -> None:
        """Count the graphs compiled since ``before`` (:func:`~autotune.trial.warmup.compile_counts`)
        and warn, once, where dynamo gave up compiling new shapes."""
        import warnings

        from autotune.trial.warmup import compile_counts, fallback_note

        compiled, fell_back = (now - then for now, then in zip(compile_counts(), before, strict=True))
        if counted:
            self.n_compiles += compiled
        if fell_back and not self._warned:
            self._warned = True
            warnings.warn(f"predict: {fallback_note(fell_back)}.", stacklevel=3)

    def __call__(self, dataset: Any) -> Sequence[Any]:
        """Every sample's output of ``dataset`` (samples, or a DataLoader over them), in order."""
        import torch

        from autotune.batching import MASK_KEY
        from autotune.batching.outputs import gather_outputs
        from autotune.run.apply import _unloaded
        from autotune.samples import call_model, collector_frozen, outputs_to_cpu, sample_inputs, to_device
        from autotune.trial.warmup import compile_counts

        dataset, collate_fn = _unloaded(dataset, self.collate_fn)
        loader, order, inverse = self._loader(dataset, collate_fn)
        where = torch.device(self.device)
        non_blocking = bool(loader.pin_memory) and where.type == "cuda"
        # A DataLoader's batches are on the CPU already: moving them there again costs a small
        # model's forward pass a few percent per batch, for nothing.
        move = where.type != "cpu"
        before = compile_counts()
        if loader.collate_fn is not None and _pads_images(loader.collate_fn):
            if self._sizes is None or self._sizes[0] is not dataset:
                from autotune.shapes import image_sizes

                self._sizes = (dataset, image_sizes(dataset))
            outputs = _image_outputs(self.model, loader, order, self._sizes[1], where, non_blocking)
            self._compiled(before)
            return outputs
        chunks = []
        with torch.inference_mode(), collector_frozen():
            for batch in loader:
                out = call_model(self.model, to_device(batch, where, non_blocking=non_blocking) if move else batch)
                inputs = sample_inputs(batch)
                mask = None if inputs is None else inputs.get(MASK_KEY)
                chunks.append((outputs_to_cpu(out), mask.cpu() if isinstance(mask, torch.Tensor) else mask))
        self._compiled(before)
        return gather_outputs(chunks, inverse)

    predict = __call__


# What a build keeps between its predictors, held no longer than the build: the loader its last
# predictor read (Predictor._loader), under this key. Not on the model itself: a user's
# torch.save or deepcopy of an applied model would carry the samples along.
_KEPT: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_LOADER = "loader"


def _kept(model: Any) -> dict[str, Any]:
    """What ``model``'s build keeps between its predictors (a fresh dict, kept nowhere, for a
    model that cannot be held weakly)."""
    try:
        return _KEPT.setdefault(model, {})
    except TypeError:
        return {}


def _pads_images(collate: Any) -> bool:
    """Whether a tuned loader's collate is autotune's own for images of different sizes."""
    from autotune.shapes import pad_images

    owner = getattr(collate, "__self__", None)  # a Batching's bound collate
    return collate is pad_images or (owner is not None and owner.collate_fn is pad_images)


def _image_outputs(
    model: Any, loader: Any, order: list[int], sizes: list[tuple[int, int]], where: Any, non_blocking: bool
) -> list[Any]:
    """Every sample's output in dataset order, dense maps cut to its own image's size
    (:func:`autotune.shapes.dense_crop`); ``sizes``: every image's ``(height, width)``."""
    import torch

    from autotune.samples import call_model, collector_frozen, outputs_to_cpu, to_device
    from autotune.shapes import dense_crop

    outputs: list[Any] = [None] * len(order)
    position = 0
    with torch.inference_mode(), collector_frozen():
        for batch in loader:
            images = batch if isinstance(batch, torch.Tensor) else batch[0]  # (b, C, H, W)
            ids = order[position : position + images.shape[0]]
            position += len(ids)
            out = outputs_to_cpu(call_model(model, to_device(batch, where, non_blocking=non_blocking)))
            for i, piece in zip(ids, dense_crop(out, tuple(images.shape[-2:]), [sizes[i] for i in ids]), strict=True):
                outputs[i] = piece
    return outputs


def predictor(
    model: Any,
    config: Any = None,
    *,
    dataset: Any = None,
    collate_fn: Any = None,
    pad_values: Mapping[str, int] | None = None,
    device: str = "auto",
    **apply_kwargs: Any,
) -> Predictor:
    """A :class:`Predictor`: ``model`` tuned as ``config`` says, once, to call on any samples.

    A config is built once per process for the same model object, config and device (a copy
    of the model, or a compile, an export, a quantization or a pruning): a second predictor, a
    :func:`predict` or :func:`~autotune.load` with ``model=`` reuses it, unless the model's
    weights changed since (then it is built again, with a one-line warning).

    Args:
        model: The model as given to :func:`~autotune.optimize` (an ``nn.Module`` or a factory),
            or what :func:`~autotune.apply` returned (then it is used as it is).
        config: A dict, :class:`~autotune.Config`, ``best_config.json`` or its directory; for an
            applied model, ``None`` or the config it was applied with.
        dataset: The data the build needs (configs that prune or quantize), as for
            :func:`~autotune.apply`; a DataLoader gives its dataset and collate. With a config
            that compiles per shape (torch.compile, TorchScript, OpenVINO's CPU plugin), one
            batch of each shape the tuned loader makes of it runs here (:meth:`Predictor.warm`),
            so the calls do not compile them.
        collate_fn: The collate the run used, if it needed one.
        pad_values: As for :func:`~autotune.optimize`.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        **apply_kwargs: Other arguments of :func:`~autotune.apply` (``loss_fn``, ``prune_ignore`` ...).

    Raises:
        ConfigError: An applied model with another config, or on another device.

    Example:
        >>> import torch
        >>> run = predictor(torch.nn.Linear(4, 2), dict(batch_size=2), device="cpu")
        >>> out = run([torch.ones(4)] * 5)
        >>> len(out), tuple(out[0].shape)
        (5, (2,))
    """
    from autotune.run.apply import _unloaded, applied_as

    data, collate_fn = _unloaded(dataset, collate_fn)
    mark = applied_as(model)
    if mark is not None:
        run = _reuse(model, mark, config, device, collate_fn, pad_values)
    elif config is None:
        raise ConfigError("predictor() needs the config to tune `model` with: pass config= (result.best_config).")
    else:
        run = _built(model, config, data, collate_fn, pad_values, device, apply_kwargs)
    if data is not None and _compiles(run.config):
        run.warm(data)
    return run


def _compiles(cfg: Any) -> bool:
    """Whether ``cfg``'s model does work per input shape on first sight: torch.compile, a
    runtime that declares it (TorchScript; OpenVINO, whose CPU plugin prepares its kernels for
    each new shape) or a knob that does (cuDNN's benchmark mode), as a trial's warm-up reads it
    (:func:`~autotune.trial.warmup.compiles_per_shape`)."""
    from autotune.knobs import off_default
    from autotune.runtimes.base import REGISTRY

    runtime = REGISTRY.get(cfg.runtime)  # None for the torch model itself
    compiles = cfg.compile_mode != "none" or (runtime is not None and runtime.compiles_per_shape)
    return compiles or bool(off_default(cfg, "per_shape"))


def _costly(cfg: Any) -> bool:
    """Whether building ``cfg`` costs more than a copy: it compiles, exports, quantizes or prunes."""
    from autotune.knobs import off_default

    return cfg.compile_mode != "none" or bool(off_default(cfg, "reads_inputs"))


def _built(
    model: Any, config: Any, data: Any, collate_fn: Any, pad_values: Any, device: str, apply_kwargs: dict[str, Any]
) -> Predictor:
    """A predictor over ``model`` tuned as ``config`` says: the build this process made already
    for the same model, config and device (:mod:`autotune.run._built`), its process-wide
    settings turned on again, or one built here."""
    import json

    from autotune.env import resolve_device
    from autotune.run._built import build_once
    from autotune.run.apply import _read_config, _rebuild_of, apply

    where, cfg = resolve_device(device), _read_config(config)

    def build() -> Any:
        return apply(model, config, device=where, dataset=data, collate_fn=collate_fn, pad_values=pad_values,
                     **apply_kwargs)  # fmt: skip

    # Every build is kept, a cheap one too: built on each call, the quickstart's winner (a copy
    # of its MLP and a new loader per call, an epoch of 13 ms) ran predict() at 0.55 of apply +
    # dataloader. What the build depends on besides the model: the config with the run's draw
    # (int8 calibration), the device, and apply's other arguments by identity.
    recipe = json.dumps([cfg.to_dict(), _rebuild_of(config)], sort_keys=True, default=str)
    others = tuple(sorted((k, id(v)) for k, v in apply_kwargs.items()))
    entry = build_once(model, (recipe, where, others), build, "predict", warn=_costly(cfg))
    if entry.reused:
        _activate(cfg, where)
    run = Predictor(entry.model, cfg, where, collate_fn, pad_values)
    run.build_s = 0.0 if entry.reused else entry.build_s
    return run


def _activate(cfg: Any, device: str) -> None:
    """Turn on ``cfg``'s process-wide settings (threads, ...), as :func:`~autotune.apply` does."""
    from autotune.knobs import REGISTRY, Stage
    from autotune.knobs.state import BuildState
    from autotune.trial.build import apply_settings

    state = BuildState(model=None, device=device)
    for knob in REGISTRY.values():
        if knob.stage == Stage.RUNTIME and knob.applies(cfg.to_dict()):
            knob.apply(state, cfg[knob.name])
    apply_settings(state.settings)


def _reuse(model: Any, mark: dict[str, Any], config: Any, device: str, collate_fn: Any, pad_values: Any) -> Predictor:
    """A predictor over a model :func:`~autotune.apply` already returned, if ``config`` and
    ``device`` agree with how it was built."""
    from autotune.config import Config
    from autotune.env import resolve_device
    from autotune.run.apply import _read_config

    built = Config(mark["config"])
    if config is not None and _read_config(config) != built:
        raise ConfigError(
            "`model` was already tuned by autotune.apply with another config: pass the original model with this "
            "config, or this model with config=None (the one it was built with)."
        )
    if device != "auto" and resolve_device(device) != mark["device"]:
        raise ConfigError(
            f"`model` was tuned by autotune.apply for {mark['device']!r}, but device={device!r}: pass the original "
            "model to tune it for this device, or leave device='auto'."
        )
    return Predictor(model, built, mark["device"], collate_fn, pad_values)


def predict(
    model: Any,
    dataset: Any,
    config: Any = None,
    *,
    collate_fn: Any = None,
    pad_values: Mapping[str, int] | None = None,
    device: str = "auto",
) -> Sequence[Any]:
    """Every sample's output, in dataset order, from ``model`` tuned and batched as ``config``
    says (its batch size, workers, padding and length grouping, whatever order the batches run in).

    A one-shot :func:`predictor`. A config is built once per process (a copy of the model, or
    a compile, an export, a quantization or a pruning): a later call with the same model object,
    config and device reuses that build and its loader, so a compiled model compiles on the
    first call only (one batch of each shape the tuned loader makes of ``dataset`` runs first;
    the cost is :attr:`Predictor.build_s` and :attr:`Predictor.compile_s` of a
    :func:`predictor`). A model changed since (its weights updated in place, through torch) is
    tuned again, with a warning. A build that needs data (int8 calibration) uses the first call's.

    Args:
        model: The model (an ``nn.Module`` or a factory), as given to :func:`~autotune.optimize`,
            or what :func:`~autotune.apply` returned.
        dataset: The samples, or a DataLoader over them (its dataset and collate are used; the
            batches are the tuned ones).
        config: A dict, :class:`~autotune.Config`, ``best_config.json`` or its directory (``None``
            for an applied model: the config it was built with).
        collate_fn: The collate the run used, if it needed one.
        pad_values: As for :func:`~autotune.optimize`.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Example:
        >>> import torch
        >>> out = predict(torch.nn.Linear(4, 2), [torch.ones(4)] * 5, dict(batch_size=2), device="cpu")
        >>> len(out), tuple(out[0].shape)
        (5, (2,))
    """
    run = predictor(model, config, dataset=dataset, collate_fn=collate_fn, pad_values=pad_values, device=device)
    return run(dataset)
