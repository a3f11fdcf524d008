"""Where the slots run: threads of this process ("local"), or Dask distributed ("dask").

Both take jobs (slot.Job) with a priority (lower first) and hand back (job, result) as each
finishes, in any order; `abort` stops what is in flight (its results are not verdicts), `close`
stops the slots and their workers.

Dask, not a home-made queue, for more than one host: its scheduler balances the jobs over the
workers, and a job on a GPU declares the resource {"GPU": 1}, so that each worker with
`--resources GPU=1` runs one at a time. Its wheels are pure Python (dask 1.5 MB, distributed
1.0 MB), where Ray's is ~70 MB: the GPU machine takes at most 64 MiB of wheels per run. On this
host (no --scheduler) the cluster is Dask's LocalCluster of in-process workers, one per device
(a worker named i runs on the i-th of `gpus`); with --scheduler, each worker is a process of
its own, one per GPU as dask-cuda starts them (CUDA_VISIBLE_DEVICES set, so its device is
`cuda`), and every node must reach the run's paths (a shared file system). dask and
distributed are imported only by DaskEngine.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading

from .slot import Job, Slot, SlotConfig, close_slots, run_job

_STOP = (float("inf"),)  # sorts after every job's priority


class LocalEngine:
    """A thread per slot (one per device), taking jobs from one priority queue."""

    name = "local"

    def __init__(self, configs: list[SlotConfig]):
        self.slots = [Slot(c) for c in configs]
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._done: queue.Queue = queue.Queue()
        self._order = itertools.count()
        self._pending = 0
        self._aborted = False
        self._threads = [threading.Thread(target=self._serve, args=(s,), daemon=True,
                                          name=f"judge-{s.device}-{i}")
                         for i, s in enumerate(self.slots)]
        for t in self._threads:
            t.start()

    def _serve(self, slot: Slot) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            if not self._aborted:  # a job taken as the run was stopped: not started
                self._done.put((job, slot.run(job)))

    def submit(self, job: Job, priority: tuple) -> None:
        self._pending += 1
        self._jobs.put((priority, next(self._order), job))

    def pending(self) -> int:
        return self._pending

    def next_result(self, timeout: float) -> tuple[Job, dict] | None:
        try:
            out = self._done.get(timeout=timeout)
        except queue.Empty:
            return None
        self._pending -= 1
        return out

    def lines(self) -> list[str]:
        """Per slot: its device and the job it runs."""
        return [f"{s.device}: {s.current or 'idle'}" for s in self.slots]

    def abort(self) -> None:
        """Drop the queued jobs and kill the workers in flight (their jobs end as crashes,
        which the caller does not keep)."""
        from ..guard.supervisor import kill_all
        self._aborted = True
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        kill_all()

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put((_STOP, next(self._order), None))
        for t in self._threads:
            t.join()
        for s in self.slots:
            s.close()


class DaskEngine:
    """Jobs as Dask tasks: a LocalCluster of in-process workers, one per device, or the
    cluster whose scheduler is at `scheduler`."""

    name = "dask"

    def __init__(self, config: SlotConfig, workers: int, gpus: tuple[int, ...] | None = None,
                 scheduler: str | None = None):
        from distributed import Client, LocalCluster
        self.cuda = config.device.startswith("cuda")
        self.resources = {"GPU": 1} if self.cuda else None
        self.cluster = None
        if scheduler is None:
            self.cluster = LocalCluster(n_workers=workers, threads_per_worker=1,
                                        processes=False, dashboard_address=None,
                                        resources=self.resources)
            self.client = Client(self.cluster)
        else:
            self.client = Client(scheduler, timeout=60)
        self.config = config
        self.gpus = gpus if scheduler is None else None
        self._futures: dict = {}

    def device_labels(self) -> set[str]:
        """The device label (slot.device_label) every worker reports for its device."""
        from .slot import device_label
        return set(self.client.run(device_label, self.config.device).values())

    def submit(self, job: Job, priority: tuple) -> None:
        # Dask runs higher priorities first; a job's own is (problem rank, kind, index).
        rank = -(priority[0] * 1_000_000 + priority[1] * 100_000 + priority[2] % 100_000)
        future = self.client.submit(_run, job, self.config, self.gpus, pure=False,
                                    priority=rank, resources=self.resources)
        self._futures[future] = job

    def pending(self) -> int:
        return len(self._futures)

    def next_result(self, timeout: float) -> tuple[Job, dict] | None:
        from distributed import wait
        if not self._futures:
            return None
        try:
            done = wait(list(self._futures), timeout=timeout, return_when="FIRST_COMPLETED").done
        except (TimeoutError, asyncio.TimeoutError):  # none within `timeout` (one since 3.11)
            return None
        future = next(iter(done))
        job = self._futures.pop(future)
        try:
            return job, future.result()
        except Exception as exc:  # noqa: BLE001 - the worker was lost, the task cancelled
            return job, {"error": f"dask: {type(exc).__name__}: {exc}"}

    def lines(self) -> list[str]:
        running = self.client.processing()
        return [f"dask {addr}: {len(keys)} job(s)" for addr, keys in sorted(running.items())]

    def abort(self) -> None:
        from ..guard.supervisor import kill_all
        self.client.cancel(list(self._futures))
        self._futures.clear()
        self.client.run(kill_all)

    def close(self) -> None:
        try:
            self.client.run(close_slots)
        finally:
            self.client.close()
            if self.cluster is not None:
                self.cluster.close()


def _run(job: Job, config: SlotConfig, gpus: tuple[int, ...] | None) -> dict:
    """A Dask task: `job` in this worker's slot; on a local cluster's GPU worker named i, on
    cuda:gpus[i]."""
    if gpus is not None and config.device.startswith("cuda"):
        from dataclasses import replace

        from distributed import get_worker
        config = replace(config, device=f"cuda:{gpus[int(get_worker().name)]}")
    return run_job(job, config)
