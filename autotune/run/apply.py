"""``apply`` and ``dataloader``: a configuration reproduced in the user's own code."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.config import Config
from autotune.errors import ConfigError, InputError, TrialError

__all__ = ["applied_as", "apply", "dataloader"]

# Set on what apply() returns: the config and device it was built with, so it is not tuned twice.
_MARK = "_autotune_applied"


def _read_config(config: Any) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "best_config.json"
        if not path.is_file():
            raise ConfigError(f"No config at {str(path)!r}: give a dict, a best_config.json or its directory.")
        return Config.from_json(path.read_text())
    if isinstance(config, Mapping):
        return Config(config)
    raise ConfigError(
        f"`config` must be a dict, a Config or a path to best_config.json or its run, but got {type(config).__name__}."
    )


def apply(
    model: Any,
    config: Any,
    *,
    device: str = "auto",
    dataset: Any = None,
    loss_fn: Any = None,
    train_dataset: Any = None,
    prune_ignore: tuple[str, ...] = (),
    collate_fn: Any = None,
    pad_values: Mapping[str, int] | None = None,
) -> Any:
    """Return ``model`` tuned as ``config`` says (a copy; the original is untouched).

    The returned module takes the same inputs and returns float32 outputs. Process-wide
    settings in the config (``num_threads``, ``cudnn_benchmark``, ``tf32``) are applied to this
    process. Configs that prune, quantize or run on another runtime read example inputs (to
    trace, convert, calibrate): a run's own config (its folder, its ``best_config.json`` or
    ``result.best_config``) brings the batches the run drew, kept in its folder by the export;
    a hand-written config, or a run exported with nothing, needs ``dataset``, and fine-tuning
    trains with ``loss_fn`` on ``train_dataset`` (default ``dataset``), as during the search. Give the same data as to :func:`~autotune.optimize` to get the same model
    (and the same ``collate_fn``, for samples that need one): the example and calibration
    samples are the run's own draw (its seed, validation subset and baseline batch size), and
    ``int8_fallback`` keeps the very layers the run kept float. Both are read from a run's
    ``best_config.json`` (or its directory), or from the ``rebuild`` entry ``result.best_config``
    carries for an int8 winner; a hand-written dict draws as a run with default options does and
    ranks the layers again.

    Raises:
        ConfigError: ``model`` is what ``apply`` returned already (pass the original model).

    Example:
        >>> import torch
        >>> fast = apply(torch.nn.Linear(4, 2), dict(amp_dtype="bfloat16"), device="cpu")
        >>> fast(torch.randn(3, 4)).dtype
        torch.float32
    """
    import torch

    from autotune.env import resolve_device
    from autotune.run.plan import _check_model
    from autotune.trial.build import apply_settings, build

    _check_model(model)
    if applied_as(model) is not None:
        raise ConfigError(
            "`model` is already what autotune.apply returned; tuning it again would stack a second build on the first: "
            "pass the original model."
        )
    if not isinstance(model, torch.nn.Module):
        model = model()
    from autotune.export.hf import as_module

    model = as_module(model)  # a SentenceTransformer, called as every phase calls a model
    cfg = _read_config(config)
    dataset, collate_fn = _unloaded(dataset, collate_fn)
    extras, rebuild = None, _rebuild_of(config)
    if dataset is not None:
        collate = base_collate(dataset, collate_fn, pad_values)
        extras = _extras(dataset, cfg, rebuild, collate, train_dataset)
        extras.loss_fn, extras.prune_ignore = loss_fn, tuple(prune_ignore)
        if train_dataset is not None:
            extras.train_dataset = train_dataset
    elif not cfg.finetune_steps:  # the run's own batches, kept in its folder by the export
        extras = _stored_extras(config, cfg, rebuild)
    where = resolve_device(device)
    state = build(model, cfg, where, extras=extras)
    apply_settings(state.settings)
    setattr(state.model, _MARK, {"config": cfg.to_dict(), "device": where})
    return state.model


def applied_as(model: Any) -> dict[str, Any] | None:
    """How :func:`apply` built ``model`` (``{"config": ..., "device": ...}``), or ``None`` when
    ``model`` is not something it returned."""
    mark = getattr(model, _MARK, None) if not isinstance(model, type) else None
    return mark if isinstance(mark, dict) else None


def _unloaded(dataset: Any, collate_fn: Any) -> tuple[Any, Any]:
    """The samples and collate of a DataLoader given where a dataset goes, as ``optimize`` reads
    one (its own collate unless ``collate_fn`` is given); anything else as it is."""
    from torch.utils.data import DataLoader

    from autotune.run.plan import loader_collate

    if not isinstance(dataset, DataLoader):
        return dataset, collate_fn
    if dataset.batch_size is None:
        raise InputError(
            "This DataLoader has batch_size=None (it yields single samples or uses a batch_sampler): pass its "
            "dataset and collate_fn instead."
        )
    own = loader_collate(dataset)
    return dataset.dataset, collate_fn or own


# The search's draw under default options (n_val, seed, baseline batch size, calibration batches):
# what a config without a run's record is rebuilt with.
_DEFAULT_DRAW = {"n_val": 512, "seed": 0, "calibration_batch_size": 32, "n_calibration": 8}


def _rebuild_of(config: Any) -> dict[str, Any]:
    """How the run drew its example and calibration samples and which int8 layers it kept float:
    ``best_config.json``'s ``rebuild`` (and ``int8``) for a run's file, directory or whole dict,
    the ``rebuild`` entry of ``result.best_config`` for a dict, the default draw otherwise."""
    from autotune.config import split_record

    record: dict[str, Any] = {}
    if isinstance(config, (str, Path)):
        record = split_record(_saved(config))[1] or {}
    elif isinstance(config, Config):
        record = dict(config.rebuild or {})
    elif isinstance(config, Mapping):
        record = split_record(config)[1] or {}
    return {**_DEFAULT_DRAW, **record}


def _saved(config: str | Path) -> dict[str, Any]:
    """The whole ``best_config.json`` at ``config`` (the file or its directory); ``{}`` if unreadable."""
    import json

    path = Path(config) / "best_config.json" if Path(config).is_dir() else Path(config)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _extras(dataset: Any, cfg: Config, rebuild: dict[str, Any], collate: Any, train_dataset: Any = None) -> Any:
    """The build's data as the search had it: its example batch, its calibration batches (the
    same seeded draw at the baseline batch size, :func:`autotune.data.calibration_draw`), its
    seed, and the int8 layers it kept float."""
    from autotune.knobs.state import BuildExtras
    from autotune.samples import calibration_draw, calibration_split

    n_train = len(train_dataset) if train_dataset is not None else None
    # A run's record holds its split already; a hand-written config gets the split a run would
    # make on this dataset, so a small one still keeps calibration samples out of validation.
    n_val = calibration_split(len(dataset), rebuild["n_val"], n_train is not None)[0]
    example, picked, from_train = calibration_draw(
        len(dataset), n_val, rebuild["seed"], rebuild["calibration_batch_size"], rebuild["n_calibration"], n_train
    )
    source = train_dataset if from_train else dataset
    extras = BuildExtras(
        example=collate([dataset[i] for i in example]),
        calibration=[collate([source[i] for i in ids]) for ids in picked],
        train_dataset=dataset,
        batch_size=cfg.batch_size,
        seed=rebuild["seed"],
    )
    _as_run(extras, rebuild, dataset)
    return extras


def _as_run(extras: Any, rebuild: dict[str, Any], dataset: Any = None) -> None:
    """What the run knew of its model besides the batches: the int8 layers it kept float, and
    whether outputs change shape with the input (a graph converted for any image size)."""
    kept = rebuild.get("int8_kept_float")
    if isinstance(kept, list):
        from autotune.compress.fallback import Int8Plan

        extras.int8 = Int8Plan(keep=list(kept))  # the run's own layers kept float, not a new ranking
    if "ragged" in rebuild:
        extras.ragged = int(rebuild["ragged"] or 0)
    elif dataset is not None:
        from autotune.data import describe

        extras.ragged = int(describe(dataset).images_vary)


def _stored_extras(config: Any, cfg: Config, rebuild: dict[str, Any]) -> Any:
    """The run's example and calibration batches from its folder (``None`` where it kept none):
    ``rebuild["inputs"]`` names a file in the run's folder, or, in ``result.best_config``, its
    whole path."""
    from autotune.errors import InputError
    from autotune.export.build_inputs import read_build_inputs
    from autotune.knobs.state import BuildExtras

    name = rebuild.get("inputs")
    if not isinstance(name, str) or not name:
        return None
    if isinstance(config, (str, Path)):
        folder = (Path(config) if Path(config).is_dir() else Path(config).parent).resolve()
        path = (folder / name).resolve()
        if path.parent != folder:
            raise InputError(f"The run's record names build inputs outside its folder ({name!r}): refused.")
    else:
        path = Path(name)
    if not path.is_file():
        return None
    example, calibration = read_build_inputs(path)
    extras = BuildExtras(example=example, calibration=calibration, batch_size=cfg.batch_size, seed=rebuild["seed"])
    _as_run(extras, rebuild)
    return extras


def base_collate(
    dataset: Any, collate_fn: Any = None, pad_values: Mapping[str, int] | None = None, info: Any = None
) -> Any:
    """The collate a run used for ``dataset``: ``collate_fn``, the padding collate for token
    sequences of different lengths, or ``default_collate``. ``info`` is ``dataset``'s
    :func:`~autotune.data.describe` where the caller has it (describing reads samples again)."""
    import functools

    from torch.utils.data import default_collate

    from autotune.batching import pad_collate
    from autotune.data import describe

    if collate_fn is not None:
        return collate_fn
    collate = (info if info is not None else describe(dataset, None, pad_values)).collate
    if collate == "pad":
        return functools.partial(pad_collate, pad_values=dict(pad_values or {}))
    if collate == "image":
        from autotune.shapes import pad_images

        return pad_images
    return default_collate


def _batching(dataset: Any, cfg: Config, collate_fn: Any, pad_values: Mapping[str, int] | None) -> Any:
    from autotune.batching import Batching, lengths_of
    from autotune.data import describe
    from autotune.knobs.state import image_multiple
    from autotune.shapes import image_sizes, size_keys

    info = describe(dataset, collate_fn, pad_values)
    sequence = info.sequence is not None
    lengths = lengths_of(dataset) if sequence and cfg.length_grouping else None
    if info.images_vary and cfg.size_grouping:
        lengths = size_keys(image_sizes(dataset))
    return Batching(
        batch_size=cfg.batch_size,
        collate_fn=base_collate(dataset, collate_fn, pad_values, info),
        padding=cfg.padding,
        grouping=cfg.length_grouping or (cfg.size_grouping if info.images_vary else 0),
        lengths=lengths,
        image_multiple=image_multiple(cfg.image_padding) if info.collate == "image" else 1,
    )


def dataloader(
    dataset: Any,
    config: Any,
    *,
    collate_fn: Any = None,
    pad_values: Mapping[str, int] | None = None,
    device: str | None = None,
    **overrides: Any,
) -> Any:
    """A DataLoader with the tuned batch size and loader settings.

    Args:
        dataset: The dataset.
        config: A dict, :class:`Config`, ``best_config.json`` or its directory.
        collate_fn: The collate the run used, if it needed one; its ``padding`` is applied on
            top. With ``length_grouping``, batches hold samples of similar lengths, so they do
            not come in dataset order (:func:`predict` puts outputs back in order).
        pad_values: As for :func:`~autotune.optimize`.
        device: Where the model runs (``"cuda"``, ``"cuda:N"``, ``"auto"``...). With
            ``device_prefetch`` in the config and a CUDA device, the loader yields batches
            already there, each copied on a side stream while the one before it is used (a
            :class:`~autotune.knobs.prefetch.DevicePrefetcher`; ``batch.to(device)`` is then a
            no-op). Without ``device`` the prefetcher is off and batches stay on the CPU. With
            ``feed_ahead``, a background thread makes the batches ahead of the loop.
        **overrides: Any other DataLoader argument (``shuffle=True`` for training, say); with
            any, batches keep the plain order.

    With ``gather="batched"``, a dataset whose samples are rows of tensors (a ``TensorDataset``,
    ``__getitem__`` returning ``self.x[i]``, a list of equal-shape samples) is read a batch at a
    time: the same batches, one index per tensor (not with a ``collate_fn`` override). With
    ``pin_memory``, copy the batches with ``non_blocking=True``, as the run did.

    Example:
        >>> import torch
        >>> loader = dataloader([torch.zeros(3)] * 10, dict(batch_size=4))
        >>> [b.shape[0] for b in loader]
        [4, 4, 2]
    """
    import torch

    from autotune.knobs.state import BuildState, TunedDataLoader

    cfg = _read_config(config)
    dataset, collate_fn = _unloaded(dataset, collate_fn)
    state = BuildState(model=None, device="cpu")
    from autotune.knobs import REGISTRY, Stage

    for knob in REGISTRY.values():
        if knob.stage == Stage.LOADER:
            knob.apply(state, cfg[knob.name])
    if state.loader_kwargs.get("pin_memory") and not torch.cuda.is_available():
        state.loader_kwargs["pin_memory"] = False
    if state.jpeg_draft and not state.device_decode:
        # JPEGs decoded at reduced scale, as the run's trials read them; the samples the batching
        # looks at are read so too (a photo's full decode costs twice a drafted one).
        from autotune.knobs.decode import drafted_dataset

        dataset = drafted_dataset(dataset)
    batching = _batching(dataset, cfg, collate_fn, pad_values)
    collate = batching.collate
    from autotune.knobs.gather import gathered_for
    from autotune.knobs.resident import host_free_kwargs, on_device

    if state.device_decode:  # the files decoded and transformed on the GPU, as the run's trials did
        return _decoded(dataset, state, batching, device, overrides)
    resident = state.device_resident and "collate_fn" not in overrides
    fast = gathered_for(dataset, state, batching) if "collate_fn" not in overrides and not resident else None
    if resident:
        dataset, collate = _resident(dataset, device), batching.finish
    elif fast is not None:
        dataset, collate = fast, batching.finish
    elif cfg.cache_decoded:
        from autotune.knobs.cache import cached

        dataset = cached(dataset)
    if on_device(dataset) or resident:  # read on the device: no workers, nothing to pin
        state.loader_kwargs = host_free_kwargs(state.loader_kwargs)
    plan = batching.sampler(len(dataset))
    if plan is not None and not overrides:
        kwargs = {k: v for k, v in state.loader_kwargs.items() if k != "batch_size"}
        loader = TunedDataLoader(dataset, batch_sampler=plan, collate_fn=collate, **kwargs)
    else:
        loader = TunedDataLoader(dataset, **{**state.loader_kwargs, "collate_fn": collate, **overrides})
    return _prefetched(loader, state, device)


def _decoded(dataset: Any, state: Any, batching: Any, device: str | None, overrides: dict[str, Any]) -> Any:
    """The loader of a ``device_decode`` config: the folder's files read as bytes, decoded and
    transformed on ``device`` (a CUDA one)."""
    from torch.utils.data import default_collate

    from autotune.env import resolve_device
    from autotune.knobs.device_decode import DeviceDecoded, EncodedFolder, encoded_collate, plan_for
    from autotune.knobs.state import TunedDataLoader

    where = resolve_device(device) if device is not None else None
    if where is None or not where.startswith("cuda"):
        raise InputError(
            f"The config decodes images on the GPU (device_decode=true), so the loader needs a CUDA device, but got "
            f"device={device!r}: pass device='cuda', or a config with device_decode=False."
        )
    found, why = plan_for(dataset)
    if found is None or batching.collate_fn not in (None, default_collate) or "collate_fn" in overrides:
        why = why or "a collate_fn of your own makes the batches"
        raise InputError(f"device_decode cannot read this dataset: {why}; pass a config with device_decode=False.")
    loader = TunedDataLoader(
        EncodedFolder(dataset), **{**state.loader_kwargs, "collate_fn": encoded_collate, **overrides}
    )
    return _prefetched(DeviceDecoded(loader, found, where), state, where)


def _resident(dataset: Any, device: str | None) -> Any:
    """``dataset``'s samples on ``device`` (the host's memory without one), for ``device_resident``."""
    from autotune.env import resolve_device
    from autotune.knobs.resident import resident

    where = resolve_device(device) if device is not None else "cpu"
    try:
        return resident(dataset, where)
    except TrialError as exc:
        raise InputError(f"{exc}; pass another dataset, or a config with device_resident=False.") from None


def _prefetched(loader: Any, state: Any, device: str | None) -> Any:
    """``loader`` behind a :class:`~autotune.knobs.prefetch.DevicePrefetcher` where the config
    feeds ahead, or prefetches and ``device`` is a CUDA device, else ``loader``."""
    from autotune.knobs.prefetch import fed

    if device is not None:
        from autotune.env import resolve_device

        device = resolve_device(device)
    return fed(loader, state, device)
