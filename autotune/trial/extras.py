"""What a worker draws once for every build (:class:`~autotune.knobs.state.BuildExtras`): the
example and calibration batches, outside the validation subset where it can; what fine-tuning
trains on; what length or size grouping sorts samples by."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotune.batching import lengths_and_width
from autotune.config import values_of
from autotune.knobs.state import BuildExtras
from autotune.trial.spec import WorkerSpec

__all__ = ["finetune_dataset", "make_extras"]


def make_extras(spec: WorkerSpec, collate: Callable[[list[Any]], Any]) -> BuildExtras:
    """Example and calibration batches, drawn once, outside the validation subset if possible,
    each made by ``collate`` (the run's, as given: no trimming)."""
    from autotune.samples import calibration_draw

    size = values_of(spec.baseline).batch_size
    # Never a sample the guard scores (see autotune.data.calibration_draw); apply() draws the
    # same, so the model it rebuilds is the one measured.
    n_train = len(spec.train_dataset) if spec.train_dataset is not None else None
    example, picked, from_train = calibration_draw(
        len(spec.dataset), len(spec.val_indices), spec.seed, size, spec.n_calibration, n_train
    )
    source = spec.train_dataset if from_train else spec.dataset
    calibration = [collate([source[i] for i in ids]) for ids in picked]
    keys, width = _sort_keys(spec)
    return BuildExtras(
        # At least two samples: an export traced at batch 1 would specialise the batch size.
        example=collate([spec.dataset[i] for i in example]),
        calibration=calibration,
        loss_fn=spec.loss_fn,
        train_dataset=finetune_dataset(spec),
        batch_size=size,
        prune_ignore=tuple(spec.prune_ignore),
        seed=spec.seed,
        collate_fn=spec.collate_fn,
        lengths=keys,
        images=spec.images,
        width=width,
    )


def _sort_keys(spec: WorkerSpec) -> tuple[list[Any] | None, int | None]:
    """What ``length_grouping`` or ``size_grouping`` sorts samples by: token sequences' lengths,
    images' shapes and sizes; ``None`` for other samples. And the one width token sequences
    are stored at, if they share one."""
    if spec.sequence:
        return lengths_and_width(spec.dataset)
    if spec.images:
        from autotune.shapes import image_sizes, size_keys

        return size_keys(image_sizes(spec.dataset)), None
    return None, None


def finetune_dataset(spec: WorkerSpec) -> Any:
    """What recovery fine-tuning trains on: ``train_dataset``, else the dataset's samples outside
    the validation subset, so nothing trains on what the guard scores."""
    if spec.train_dataset is not None:
        return spec.train_dataset
    from torch.utils.data import Subset

    held = set(spec.val_indices)
    return Subset(spec.dataset, [i for i in range(len(spec.dataset)) if i not in held])
