# SPDX-License-Identifier: Apache-2.0
"""A dataloader that records its position: ``state_dict()`` / ``load_state_dict()`` for exact resume.

:class:`StatefulDataLoader` wraps a ``torch.utils.data.DataLoader``. Its state is the epoch and the number of
batches already yielded in it; after ``load_state_dict`` the next iteration skips those batches *in the batch
sampler* (no data is loaded for them) and sets the sampler's epoch (``DistributedSampler.set_epoch``), so the
rest of the epoch comes in the same order when the sampler is deterministic for an epoch
(``DistributedSampler``, ``SequentialSampler``, samplers with a seeded generator). Objects that already have
``state_dict``/``load_state_dict`` (torchdata's ``StatefulDataLoader``) are returned unchanged by
:func:`make_stateful`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

__all__ = ["StatefulDataLoader", "make_stateful"]


class _SkipBatches:
    """A batch sampler that drops the first ``skip`` batches of ``inner``."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.inner):
            if i >= self.skip:
                yield batch

    def __len__(self) -> int:
        return max(len(self.inner) - self.skip, 0)


class StatefulDataLoader:
    """Iterate ``loader`` and remember where: ``state_dict() == {"epoch": e, "batches_yielded": n}``.

    Args:
        loader: a ``DataLoader``. Map-style datasets skip resumed batches without loading them; iterable
            datasets are advanced by drawing and dropping batches.

    Every full pass increments ``epoch`` and calls ``sampler.set_epoch(epoch)`` when the sampler has it.
    Attributes of the wrapped loader (``dataset``, ``batch_size``, ``sampler``...) are reachable here.
    """

    def __init__(self, loader: DataLoader[Any]) -> None:
        if not isinstance(loader, DataLoader):
            raise TypeError(
                f"StatefulDataLoader: loader must be a torch DataLoader, got {type(loader).__name__}."
            )
        self.loader = loader
        self.epoch = 0
        self.batches_yielded = 0
        self._resume = 0

    def __len__(self) -> int:
        return len(self.loader)

    def _set_epoch(self) -> None:
        samplers: tuple[Any, ...] = (
            getattr(self.loader, "sampler", None),
            getattr(self.loader, "batch_sampler", None),
        )
        for sampler in samplers:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)

    def _iterator(self, skip: int) -> Iterator[Any]:
        if skip == 0:
            return iter(self.loader)
        ld = self.loader
        if isinstance(ld.dataset, IterableDataset) or ld.batch_sampler is None:
            it = iter(ld)
            for _ in range(skip):
                next(it, None)
            return it
        clone = DataLoader(
            ld.dataset,
            batch_sampler=_SkipBatches(ld.batch_sampler, skip),
            num_workers=ld.num_workers,
            collate_fn=ld.collate_fn,
            pin_memory=ld.pin_memory,
            timeout=ld.timeout,
            worker_init_fn=ld.worker_init_fn,
            multiprocessing_context=ld.multiprocessing_context if ld.num_workers > 0 else None,
            generator=ld.generator,
            prefetch_factor=ld.prefetch_factor if ld.num_workers > 0 else None,
        )
        return iter(clone)

    def __iter__(self) -> Iterator[Any]:
        skip, self._resume = self._resume, 0
        self._set_epoch()
        self.batches_yielded = skip
        for batch in self._iterator(skip):
            self.batches_yielded += 1
            yield batch
        self.epoch += 1
        self.batches_yielded = 0

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": ..., "batches_yielded": ...}`` (batches of the current epoch already handed out)."""
        return {"epoch": self.epoch, "batches_yielded": self.batches_yielded}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next iteration continues epoch ``state["epoch"]`` after its yielded batches."""
        try:
            epoch, done = int(state["epoch"]), int(state["batches_yielded"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"StatefulDataLoader.load_state_dict: expected {{'epoch': int, 'batches_yielded': int}}, got "
                f"{dict(state)!r}."
            ) from exc
        if epoch < 0 or done < 0:
            raise ValueError(f"StatefulDataLoader.load_state_dict: negative position {dict(state)!r}.")
        self.epoch = epoch
        self.batches_yielded = done
        self._resume = done

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


def make_stateful(dataloader: Any) -> Any:
    """``dataloader`` itself when it has ``state_dict``/``load_state_dict``, else a :class:`StatefulDataLoader`."""
    if hasattr(dataloader, "state_dict") and hasattr(dataloader, "load_state_dict"):
        return dataloader
    if isinstance(dataloader, DataLoader):
        return StatefulDataLoader(dataloader)
    raise TypeError(
        f"Booster.boost: dataloader must be a torch DataLoader or have state_dict/load_state_dict, got "
        f"{type(dataloader).__name__}."
    )
