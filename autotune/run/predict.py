"""``predictor`` and ``predict``: a tuned model applied once, run over samples through the tuned
loader, outputs put back in dataset order.

What a run's claim timed is the tuned model fed by the tuned DataLoader (:func:`~autotune.apply`
plus :func:`~autotune.dataloader`); a :class:`Predictor` runs that same pipeline, building the
model once and ordering the outputs once per call.
"""

from __future__ import annotations

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

    Attributes:
        model: The tuned model (what :func:`~autotune.apply` returned).
        config: The configuration it was built with.
        device: Where it runs.
    """

    def __init__(
        self, model: Any, config: Any, device: str, collate_fn: Any = None, pad_values: Mapping[str, int] | None = None
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.collate_fn = collate_fn
        self.pad_values = pad_values
        # The last dataset, its loader, and its order as a list and inverted (batching.inverse_order).
        self._cached: tuple[Any, Any, list[int], Any] | None = None
        self._sizes: tuple[Any, list[tuple[int, int]]] | None = None  # images: the last dataset's sizes

    def __call__(self, dataset: Any) -> Sequence[Any]:
        """Every sample's output of ``dataset`` (samples, or a DataLoader over them), in order."""
        import torch

        from autotune.batching import MASK_KEY, gather_outputs, inverse_order
        from autotune.data import call_model, collector_frozen, outputs_to_cpu, sample_inputs, to_device
        from autotune.run.apply import _unloaded, dataloader

        dataset, collate_fn = _unloaded(dataset, self.collate_fn)
        if self._cached is not None and self._cached[0] is dataset:
            # The same samples again: the same loader (its persistent workers stay up) and order.
            loader, order = self._cached[1:3]
        else:
            loader = dataloader(dataset, self.config, collate_fn=collate_fn, pad_values=self.pad_values)
            order = [i for ids in loader.batch_sampler for i in ids]
            self._cached = (dataset, loader, order, inverse_order(order))
        where = torch.device(self.device)
        non_blocking = bool(loader.pin_memory) and where.type == "cuda"
        # A DataLoader's batches are on the CPU already: moving them there again costs a small
        # model's forward pass a few percent per batch, for nothing.
        move = where.type != "cpu"
        if loader.collate_fn is not None and _pads_images(loader.collate_fn):
            if self._sizes is None or self._sizes[0] is not dataset:
                from autotune.shapes import image_sizes

                self._sizes = (dataset, image_sizes(dataset))
            return _image_outputs(self.model, loader, order, self._sizes[1], where, non_blocking)
        chunks = []
        with torch.inference_mode(), collector_frozen():
            for batch in loader:
                out = call_model(self.model, to_device(batch, where, non_blocking=non_blocking) if move else batch)
                inputs = sample_inputs(batch)
                chunks.append((outputs_to_cpu(out), None if inputs is None else inputs.get(MASK_KEY)))
        return gather_outputs(chunks, self._cached[3])

    predict = __call__


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

    from autotune.data import call_model, collector_frozen, outputs_to_cpu, to_device
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

    Args:
        model: The model as given to :func:`~autotune.optimize` (an ``nn.Module`` or a factory),
            or what :func:`~autotune.apply` returned (then it is used as it is).
        config: A dict, :class:`~autotune.Config`, ``best_config.json`` or its directory; for an
            applied model, ``None`` or the config it was applied with.
        dataset: The data the build needs (configs that prune or quantize), as for
            :func:`~autotune.apply`; a DataLoader gives its dataset and collate.
        collate_fn: The collate the run used, if it needed one.
        pad_values: As for :func:`~autotune.optimize`.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        **apply_kwargs: Other arguments of :func:`~autotune.apply` (``loss_fn``, ``prune_ignore`` ...).

    Raises:
        ConfigError: An applied model with another config, or on another device.

    Example:
        >>> import torch
        >>> run = predictor(torch.nn.Linear(4, 2), {"batch_size": 2}, device="cpu")
        >>> out = run([torch.ones(4)] * 5)
        >>> len(out), tuple(out[0].shape)
        (5, (2,))
    """
    from autotune.env import resolve_device
    from autotune.run.apply import _read_config, _unloaded, applied_as, apply

    mark = applied_as(model)
    if mark is not None:
        return _reuse(model, mark, config, device, collate_fn, pad_values)
    if config is None:
        raise ConfigError("predictor() needs the config to tune `model` with: pass config= (result.best_config).")
    where = resolve_device(device)
    data, collate_fn = _unloaded(dataset, collate_fn)
    tuned = apply(
        model, config, device=where, dataset=data, collate_fn=collate_fn, pad_values=pad_values, **apply_kwargs
    )
    return Predictor(tuned, _read_config(config), where, collate_fn, pad_values)


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

    A one-shot :func:`predictor`: it tunes ``model`` on each call (an int8 config quantizes again,
    a compiled one compiles again). To predict more than once, build the predictor once, or pass
    the model :func:`~autotune.apply` returned, which is used as it is.

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
        >>> out = predict(torch.nn.Linear(4, 2), [torch.ones(4)] * 5, {"batch_size": 2}, device="cpu")
        >>> len(out), tuple(out[0].shape)
        (5, (2,))
    """
    run = predictor(model, config, dataset=dataset, collate_fn=collate_fn, pad_values=pad_values, device=device)
    return run(dataset)
