"""``cache_decoded``: keep every decoded sample in memory after its first read.

A dataset that decodes in ``__getitem__`` (PNG or JPEG bytes to a tensor, a resize, a
normalisation) pays for it on every epoch, and in repeated inference over a fixed set on every
pass. Caching the decoded samples pays once; it is offered only where the decoded data fits the
memory budget. With loader workers, each worker keeps the samples it read (keep them alive
between epochs with ``persistent_workers``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register

__all__ = ["CachedDataset", "MEMORY_SHARE", "CacheDecoded"]

# The share of the machine's memory the decoded samples may take.
MEMORY_SHARE = 0.25


class CachedDataset:
    """``dataset`` with each sample kept after its first ``__getitem__``: the same samples,
    decoded once.

    Example:
        >>> calls = []
        >>> class Slow:
        ...     def __len__(self): return 3
        ...     def __getitem__(self, i): calls.append(i); return i * 10
        >>> cached = CachedDataset(Slow())
        >>> [cached[i] for i in (0, 1, 0, 1)], calls
        ([0, 10, 0, 10], [0, 1])
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._samples: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            return self._samples[index]
        except KeyError:
            sample = self._samples[index] = self.dataset[index]
            return sample

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))


def cached(dataset: Any) -> Any:
    """``dataset`` wrapped in a :class:`CachedDataset`, unless it is one already."""
    return dataset if isinstance(dataset, CachedDataset) else CachedDataset(dataset)


@register
class CacheDecoded(Knob):
    name = "cache_decoded"
    pays_on_repeats = "a cache of decoded samples"
    side = "loader"
    # Decoding once before loader workers: over repeated epochs (or repeated inference over a
    # fixed set) the cache removes the decoding that workers would only hide, and leaves the
    # cores to the model. Beside workers it needs them persistent, or each epoch loses it.
    screen = ({"cache_decoded": (True,)}, {"cache_decoded": (True,), "persistent_workers": (True,)})
    screen_rank = 100
    order = 28
    stage = Stage.LOADER
    choices = (False, True)
    default = False
    help = (
        "Keep each decoded sample in memory after its first read, so repeated epochs (and repeated inference "
        "over a fixed set) skip the dataset's decoding. Offered in training, and in inference with "
        "repeated_passes=True, when the decoded samples fit a quarter of the machine's memory and the dataset "
        "does not already hold them in memory."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        data = ctx.data
        if not ctx.repeated_passes:
            # A cache pays only on the second read of a sample: one pass over a stream of new
            # samples, as in serving, pays its filling and gets nothing back.
            why = "pays only when the same samples are read again: pass repeated_passes=True if they are"
            return Offer([False], {"true": why})
        if data.in_memory or getattr(data, "tensor_rows", False):
            return Offer([False], {"true": "the samples are already in memory (a list of them, or rows of tensors)"})
        need = data.sample_bytes * data.n_samples
        from autotune.env import host_memory_bytes

        budget = int(MEMORY_SHARE * host_memory_bytes())
        if need > budget:
            why = f"the decoded samples need about {need / 2**30:.1f} GiB, more than {budget / 2**30:.1f} GiB"
            return Offer([False], {"true": why})
        return Offer([False, True])

    def applies(self, config: dict[str, Any]) -> bool:
        return not config.get("device_resident", False)  # resident samples are decoded once already

    def apply(self, state: Any, value: bool) -> None:
        state.cache_decoded = value
