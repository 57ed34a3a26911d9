"""Samples through a served artifact, batched as the run's winner batched them: what
``Predictor.predict`` does, for every kind of predictor (:class:`~autotune.deploy.load.Predictor`,
:class:`~autotune.deploy.light.LightPredictor`), which call it with themselves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autotune.errors import InputError

__all__ = ["predict_images", "predict_samples"]


def predict_samples(pred: Any, samples: Sequence[Any], collate_fn: Any = None) -> list[Any]:
    """Every sample's output, in the order given, batched as the run's winner batches: its
    batch size, padding and length grouping (``best_config.json``). Each output is the
    sample's own, without a batch axis; token-level outputs keep the real tokens only.

    Args:
        samples: Samples as the dataset gives them (dicts of tensors, or a tokenizer's lists
            of ints, for text), or a DataLoader over them: its dataset and its collate.
        collate_fn: The run's own collate, when it had one (it is not saved with the run);
            a run that padded token sequences itself pads them the same way here.
    """
    from autotune.batching import Batching, lengths_of, pad_collate
    from autotune.run.apply import _unloaded

    samples, collate_fn = _unloaded(samples, collate_fn)
    data = pred.run.get("data") or {}
    if collate_fn is None and data.get("collate") == "user":
        raise InputError(
            "This run batched its samples with its own collate_fn: pass it, predict(samples, collate_fn=...)."
        )
    if collate_fn is None and data.get("collate") == "pad":
        pad_values = dict(data.get("pad_values") or {})
        collate_fn = lambda part: pad_collate(part, pad_values)  # noqa: E731
    config = pred.run.get("config") or {}
    if config.get("jpeg_draft"):  # JPEGs decoded at reduced scale, as the run's winner read them
        from autotune.knobs.decode import drafted_dataset

        samples = drafted_dataset(samples)
    if collate_fn is None and data.get("collate") == "image":
        return predict_images(pred, list(samples), config)
    if _reads_ahead(config):
        return _through_loader(pred, samples, config, collate_fn, data)
    grouping = int(config.get("length_grouping") or 0)
    batching = Batching(
        batch_size=pred.batch_size,
        collate_fn=collate_fn,
        padding=config.get("padding", "as_given"),
        grouping=grouping,
        lengths=lengths_of(samples) if grouping else None,
    )
    return _outputs(pred, batching.batches(list(samples)), len(samples))


def _outputs(pred: Any, batches: Any, n: int) -> list[Any]:
    """Each of ``n`` samples' own output (no batch axis), from ``(indices, batch)`` pairs run by
    ``pred``. Each output leaf is joined once over the batches and put back in order
    (:func:`~autotune.batching.outputs.gather_outputs`, as a predictor does): cutting every batch
    into one piece per sample in Python took 45 ms of a 100-ms pass of the quickstart's 4,096
    samples, and served the ONNX file at 0.7x the plain loop that its model alone ran 3x."""
    import torch

    from autotune.batching.outputs import gather_outputs
    from autotune.export.parity import flat_inputs
    from autotune.samples import MASK_KEY, sample_inputs

    chunks, order = [], []
    for ids, batch in batches:
        names, tensors, _ = flat_inputs(batch)
        out = pred(dict(zip(names, tensors, strict=True)))
        inputs = sample_inputs(batch)
        mask = None if inputs is None else inputs.get(MASK_KEY)
        chunks.append((out, mask if isinstance(mask, torch.Tensor) else None))
        order += list(ids)
    if len(order) != n:  # each sample is in one batch: the order is a permutation of them
        raise InputError(f"The batches held {len(order)} samples, where the dataset has {n}.")
    return list(gather_outputs(chunks, order))  # a list, as load().predict has always given


def _reads_ahead(config: Mapping[str, Any]) -> bool:
    """Whether the run's winner read its samples ahead of the model: loader workers, a thread
    making batches ahead, or rows of tensors gathered a batch at a time."""
    return bool(int(config.get("num_workers") or 0) or int(config.get("feed_ahead") or 0)) or (
        config.get("gather") == "batched"
    )


def _through_loader(
    pred: Any, samples: Any, config: Mapping[str, Any], collate_fn: Any, data: Mapping[str, Any]
) -> list[Any]:
    """Every sample's output, its samples read by the tuned DataLoader (:func:`autotune.dataloader`:
    the workers, prefetch and gathering the run measured), while the artifact runs the batches
    before them; outputs in the order given."""
    from autotune.run.apply import dataloader

    tuned = {**config, "batch_size": int(pred.batch_size)}
    pad_values = dict(data.get("pad_values") or {}) or None
    loader = dataloader(samples, tuned, collate_fn=collate_fn, pad_values=pad_values)
    plan = [list(ids) for ids in loader.batch_sampler]
    return _outputs(pred, zip(plan, loader, strict=True), len(samples))


def predict_images(pred: Any, samples: list[Any], config: Mapping[str, Any]) -> list[Any]:
    """Images of different sizes, batched as the run batched them (each batch padded to its
    largest image, rounded up to ``image_padding``'s multiple; with ``size_grouping``,
    images of similar shape together), every dense map cut back to its own image's size."""
    import torch

    from autotune.batching import Batching
    from autotune.export.parity import flat_inputs
    from autotune.knobs.state import image_multiple
    from autotune.samples import image_of
    from autotune.shapes import dense_crop, pad_images, size_keys

    found = [image_of(s) for s in samples]
    if any(image is None for image in found):
        raise InputError(
            "This run batched images of different sizes: every sample must hold a float "
            "(channels, height, width) tensor, as its dataset gave them."
        )
    sizes = [tuple(int(n) for n in image.shape[-2:]) for image in found]
    grouping = int(config.get("size_grouping") or 0)
    batching = Batching(
        batch_size=pred.batch_size,
        collate_fn=pad_images,
        grouping=grouping,
        lengths=size_keys(sizes) if grouping else None,
        image_multiple=image_multiple(str(config.get("image_padding", "largest"))),
    )
    outputs: list[Any] = [None] * len(samples)
    for ids, batch in batching.batches(samples):
        names, tensors, _ = flat_inputs(batch)
        images = batch if isinstance(batch, torch.Tensor) else batch[0]
        out = pred(dict(zip(names, tensors, strict=True)))
        for i, piece in zip(ids, dense_crop(out, tuple(images.shape[-2:]), [sizes[i] for i in ids]), strict=True):
            outputs[i] = piece
    return outputs
