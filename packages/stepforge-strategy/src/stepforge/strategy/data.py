# SPDX-License-Identifier: Apache-2.0
"""A dataloader that records its position: ``state_dict()`` / ``load_state_dict()`` for exact resume.

A resume skips the consumed batches *in the batch sampler* (no data is loaded for them). Over a
``DistributedSampler`` the position is kept in samples, which does not depend on the world size: rank ``r``
of ``W`` reads items ``r, r + W, ...`` of the epoch's ``num_replicas=1`` order, so after ``b`` batches of
``B`` the ranks consumed exactly the first ``b * B * W`` items, and a resume at any world size deals out
the rest."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

__all__ = ["StatefulDataLoader", "make_stateful"]


class _SkipBatches:
    """A batch sampler that drops the first ``skip`` batches of ``inner``."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(self.inner, self.skip, None)

    def __len__(self) -> int:
        return max(len(self.inner) - self.skip, 0)


def _rest_of_epoch(sampler: DistributedSampler[Any], epoch: int, start: int) -> list[int]:
    """This rank's share of epoch ``epoch`` after its first ``start`` items (in the order every world size
    shares), dealt out and padded or cut as ``sampler`` deals a whole epoch."""
    whole: DistributedSampler[Any] = DistributedSampler(
        sampler.dataset, num_replicas=1, rank=0, shuffle=sampler.shuffle, seed=sampler.seed
    )
    whole.set_epoch(epoch)
    order = list(whole)
    rest, ranks = order[start:], sampler.num_replicas
    if sampler.drop_last:
        rest = rest[: len(rest) - len(rest) % ranks]
    elif rest and len(rest) % ranks:
        pad = ranks - len(rest) % ranks
        rest += (order * (pad // len(order) + 1))[:pad]
    return rest[sampler.rank :: ranks]


class StatefulDataLoader:
    """Iterate ``loader`` (a ``DataLoader``) and remember where: ``{"epoch", "batches_yielded"}``, plus
    ``"samples"`` (items of the epoch consumed by all ranks) over a ``DistributedSampler``; the loader's
    attributes are reachable here."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        if not isinstance(loader, DataLoader):
            raise TypeError(
                f"StatefulDataLoader: loader must be a torch DataLoader, got {type(loader).__name__}."
            )
        self.loader = loader
        self.epoch = 0
        self.batches_yielded = 0
        self._resume = 0
        self._resume_samples: int | None = None
        # the samples of the epoch consumed before this pass's first batch, and batches_yielded then
        self._base = (0, 0)

    def __len__(self) -> int:
        return len(self.loader)

    def _distributed(self) -> DistributedSampler[Any] | None:
        """The loader's own ``DistributedSampler`` (not a subclass, whose order may be its own)."""
        sampler = self.loader.sampler
        if type(sampler) is DistributedSampler and self.loader.batch_size is not None:
            return sampler
        return None

    @property
    def samples(self) -> int | None:
        """Items of the current epoch consumed by all ranks together (``None`` without a ``DistributedSampler``)."""
        sampler = self._distributed()
        if sampler is None:
            return None
        assert self.loader.batch_size is not None
        samples, batches = self._base
        return samples + (self.batches_yielded - batches) * self.loader.batch_size * sampler.num_replicas

    def _iterator(self, skip: int, start: int | None) -> Iterator[Any]:
        ld = self.loader
        sampler = self._distributed()
        if start is not None and sampler is not None:
            assert ld.batch_size is not None
            share = _rest_of_epoch(sampler, self.epoch, start)
            return self._clone(BatchSampler(share, ld.batch_size, ld.drop_last))
        if skip == 0:
            return iter(self.loader)
        if isinstance(ld.dataset, IterableDataset) or ld.batch_sampler is None:
            it = iter(ld)
            for _ in range(skip):
                next(it, None)
            return it
        return self._clone(_SkipBatches(ld.batch_sampler, skip))

    def _clone(self, batch_sampler: Any) -> Iterator[Any]:
        """An iterator of the loader's data through ``batch_sampler``, with the loader's other settings."""
        ld = self.loader
        clone = DataLoader(
            ld.dataset,
            batch_sampler=batch_sampler,
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
        start, self._resume_samples = self._resume_samples, None
        samplers: tuple[Any, ...] = (self.loader.sampler, self.loader.batch_sampler)
        for sampler in samplers:
            if hasattr(sampler, "set_epoch"):  # DistributedSampler's protocol
                sampler.set_epoch(self.epoch)
        if start is None:  # else load_state_dict set batches_yielded and _base
            self.batches_yielded, self._base = skip, (0, 0)
        for batch in self._iterator(skip, start):
            self.batches_yielded += 1
            yield batch
        self.epoch += 1
        self.batches_yielded = 0
        self._base = (0, 0)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": ..., "batches_yielded": ...}`` (batches of the current epoch already handed out), and
        ``"samples"`` over a ``DistributedSampler`` (the world-size-free position a resume uses)."""
        state = {"epoch": self.epoch, "batches_yielded": self.batches_yielded}
        samples = self.samples
        if samples is not None:
            state["samples"] = samples
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next iteration continues epoch ``state["epoch"]`` after its consumed samples (over a
        ``DistributedSampler``, at any world size) or after its yielded batches (same world size)."""
        try:
            epoch, done = int(state["epoch"]), int(state["batches_yielded"])
            samples = None if state.get("samples") is None else int(state["samples"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"StatefulDataLoader.load_state_dict: expected {{'epoch': int, 'batches_yielded': int}} (and "
                f"'samples': int), got {dict(state)!r}."
            ) from exc
        if epoch < 0 or done < 0 or (samples is not None and samples < 0):
            raise ValueError(f"StatefulDataLoader.load_state_dict: negative position {dict(state)!r}.")
        self.epoch = epoch
        sampler = self._distributed()
        if samples is not None and sampler is not None:
            assert self.loader.batch_size is not None
            # this rank's batches of the epoch so far, as if the epoch had run at this world size
            self._resume, self._resume_samples = 0, samples
            self.batches_yielded = samples // (self.loader.batch_size * sampler.num_replicas)
            self._base = (samples, self.batches_yielded)
        else:
            self._resume, self._resume_samples, self.batches_yielded = done, None, done

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
