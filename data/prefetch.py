"""A thread that reads the next batches while the training step runs.

On a small machine (2 cores) a loader worker *process* competes with the step for the
cores and hands every batch over through shared memory; a thread in the training process
reads the next batch while the step's kernels run (PyTorch kernels and HDF5 reads let other
threads run), and the batch needs no copy. Order and content are the wrapped loader's: the
thread only runs it ahead by `depth` batches, so shuffling, shards and mid-epoch resume are
unchanged.

    loader = PrefetchLoader(DataLoader(dataset, ..., num_workers=0))
    for inp, tar in loader: ...
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

_DONE = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class PrefetchLoader:
    """Iterates `loader` in a background thread, `depth` batches ahead of the consumer."""

    def __init__(self, loader: Iterable, depth: int = 2):
        self.loader, self.depth = loader, depth

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # dataset, sampler, batch_size, ...
        return getattr(self.__dict__["loader"], name)

    def __iter__(self) -> Iterator:
        batches: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        thread = threading.Thread(target=self._produce, args=(batches, stop),
                                  name="batch prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = batches.get()
                if item is _DONE:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:  # also when the consumer stops early (break, num_iters reached)
            stop.set()
            while thread.is_alive():
                try:
                    batches.get(timeout=0.05)  # unblock a producer waiting for room
                except queue.Empty:
                    pass
            thread.join()

    def _produce(self, batches: queue.Queue, stop: threading.Event) -> None:
        try:
            for batch in self.loader:
                while not stop.is_set():
                    try:
                        batches.put(batch, timeout=0.05)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            batches.put(_DONE)
        except BaseException as e:  # re-raised in the consumer: a DataError stays one line
            batches.put(_Failed(e))
