"""Data-parallel training of one policy on N local processes (``liverl train --nproc N``).

The command spawns the ranks itself (no ``torchrun``): the ``liverl train`` process is rank 0
and starts ranks 1..N-1 with :mod:`torch.multiprocessing` (spawn), on a localhost rendezvous
(a ``TCPStore`` on a free port). Rank 0 is the only one that touches Kafka, offsets, Delta and
weight folders, so the exactly-once protocol of :mod:`publish` is unchanged; the other ranks
only compute gradients.

Per step: rank 0 broadcasts the batch's samples as Python objects (``broadcast_object_list``
on a gloo group), every rank computes the whole batch's masks (cheap, from the samples alone)
and trains its shard of the active rows (split by token cost, the same split on every rank),
and the gradients are summed with ``all_reduce`` before clipping and the optimizer step, so
the ranks' weights stay identical. Each rank's loss keeps the *whole batch's* normaliser (its
rows count toward the numerator only; see ``TrainerCore.train_step``), so the summed gradient
is the gradient one process computes on the whole batch, whatever the aggregate.

Why an explicit ``all_reduce`` and not ``DistributedDataParallel``: a step runs several
forward passes of the same model (student, teacher with the adapter off, KL reference), and a
rank whose shard has no active row runs none; DDP needs exactly one forward and backward per
rank per step. The price is no overlap of communication with the backward pass.

Failures: a rank that dies kills the step and every rank, and a restart resumes from the newest
manifest like after any crash. Rank 0 watches its workers and exits (status 1) as soon as one
exits unexpectedly; workers die with rank 0 (``PR_SET_PDEATHSIG`` on Linux, and gloo reports a
closed connection at once elsewhere). A rank that hangs fails the all-reduce after
``dist_timeout_s``. Workers ignore SIGINT/SIGTERM: a stop goes to rank 0, which finishes the
step (with them) and publishes, then tells them to stop.

``LIVERL_TRAINER_CRASH_AT=rank<R>_step<K>`` makes rank R exit (``os._exit(137)``, like a
SIGKILL) in its K-th step, after its backward pass and before the all-reduce: a test hook.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipeline.trainer.config import TrainerSettings

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.trainer.core import TrainerCore

HOST = "127.0.0.1"
# Workers wait for rank 0's next batch however long the input stays idle: the group carrying
# batches has no practical timeout (a dead rank 0 is noticed by its closed connection).
IDLE_FOREVER = timedelta(days=365)
BUCKET_ELEMENTS = 1 << 24  # gradients are summed in flat buckets of at most this many elements


def backend_for(cfg: TrainerSettings) -> str:
    """``dist_backend`` resolved: nccl for CUDA devices, gloo on CPU."""
    if cfg.dist_backend != "auto":
        return cfg.dist_backend
    return "nccl" if _uses_cuda(cfg) else "gloo"


def _uses_cuda(cfg: TrainerSettings) -> bool:
    return cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())


def rank_settings(cfg: TrainerSettings, rank: int) -> TrainerSettings:
    """Rank ``r`` trains on ``cuda:r`` (CUDA) or the CPU."""
    if _uses_cuda(cfg):
        return cfg.model_copy(update={"device": f"cuda:{rank}"})
    return cfg


def _crash_step(rank: int) -> int | None:
    """The step ``LIVERL_TRAINER_CRASH_AT=rank<R>_step<K>`` kills this rank in, if any."""
    match = re.fullmatch(r"rank(\d+)_step(\d+)", os.environ.get("LIVERL_TRAINER_CRASH_AT", ""))
    return int(match[2]) if match and int(match[1]) == rank else None


@dataclass
class RankGroup:
    """This process's place among the ranks, and the collectives the trainer needs."""

    rank: int
    world: int
    control: Any  # gloo group for Python objects (batches, step summaries)
    steps: int = 0
    crash_at: int | None = field(default=None)

    @classmethod
    def connect(
        cls, rank: int, world: int, store: Any, backend: str, timeout_s: float
    ) -> RankGroup:
        """Join the default group (gradients; ``timeout_s`` bounds a wait on a hung rank) and
        a gloo group for objects. Every rank calls this in the same order."""
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        control = dist.new_group(backend="gloo", timeout=IDLE_FOREVER)
        return cls(rank, world, control, crash_at=_crash_step(rank))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    # ---- rank 0 -> workers ---------------------------------------------------------------

    def send(self, message: tuple[Any, ...]) -> None:
        """Rank 0: one message to every worker (``load``, ``step`` or ``stop``)."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> tuple[Any, ...]:
        """Workers: the next message from rank 0 (waits as long as it takes)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        message: tuple[Any, ...] = box[0]
        return message

    def send_step(
        self, samples: Sequence[Any], version: int, staleness: Sequence[int] | None = None
    ) -> None:
        self.send(("step", list(samples), version, None if staleness is None else list(staleness)))

    def load_core(self, cfg: TrainerSettings, directory: Path | None, step: int) -> TrainerCore:
        """Every rank loads the same version (rank 0 names it), then takes rank 0's trainable
        weights so a random initialisation (a fresh adapter) cannot differ between ranks."""
        from pipeline.trainer.core import TrainerCore

        if self.rank == 0:
            self.send(("load", None if directory is None else str(directory), step))
        core = TrainerCore.load(rank_settings(cfg, self.rank), directory, step=step)
        self.attach(core)
        return core

    def attach(self, core: TrainerCore) -> None:
        """``core`` trains its shard from now on, starting from rank 0's weights."""
        with torch.no_grad():
            for p in core.model.parameters():
                if p.requires_grad:
                    dist.broadcast(p.data, src=0)
        core.dist = self

    # ---- inside a step ---------------------------------------------------------------------

    def shard(self, samples: Sequence[Any], active: torch.Tensor, uses_opd: bool) -> torch.Tensor:
        """Bool ``[B]``: the active rows this rank trains. Greedy longest-first onto the least
        loaded rank by token cost (teacher passes included), the same split on every rank."""
        flags = active.tolist()
        cost = {b: _cost(samples[b], uses_opd) for b in range(len(samples)) if flags[b]}
        load = [0] * self.world
        mine = [False] * len(samples)
        for b in sorted(cost, key=lambda b: (-cost[b], b)):
            r = min(range(self.world), key=lambda r: (load[r], r))
            load[r] += cost[b]
            mine[b] = r == self.rank
        return torch.tensor(mine, dtype=torch.bool, device=active.device)

    def all_reduce_grads(self, model: Any) -> None:
        """Sum the trainable parameters' gradients over the ranks, in flat buckets. A gradient
        absent on every rank stays absent (AdamW skips it, as in one process); one absent only
        here counts as zeros."""
        self.steps += 1
        if self.crash_at == self.steps:
            os._exit(137)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return
        device = params[0].device
        present = torch.tensor([float(p.grad is not None) for p in params], device=device)
        dist.all_reduce(present)
        for bucket in _buckets(params):
            flat = torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    for p in bucket
                ]
            )
            dist.all_reduce(flat)
            at = 0
            for p in bucket:
                summed = flat[at : at + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = summed.clone()
                else:
                    p.grad.copy_(summed)
                at += p.numel()
        for p, seen in zip(params, present.tolist(), strict=True):
            if seen == 0:
                p.grad = None

    def combine(
        self, metrics: dict[str, tuple[float, float]], hints: dict[int, str]
    ) -> tuple[dict[str, float], dict[int, str]]:
        """The whole batch's step metrics from every rank's ``{key: (value, weight)}``, and
        every rank's chosen hints by row. Losses add up (each rank's loss is its share of the
        batch's); ``*_max`` take the maximum, ``*_tokens`` the sum; the rest are means over
        tokens, weighted by the tokens each rank's value was averaged over."""
        box: list[Any] = [None] * self.world
        dist.all_gather_object(box, (metrics, hints), group=self.control)
        merged: dict[int, str] = {}
        keys: dict[str, list[tuple[float, float]]] = {}
        for rank_metrics, rank_hints in box:
            merged.update(rank_hints)
            for key, pair in rank_metrics.items():
                keys.setdefault(key, []).append(pair)
        return {key: _reduce(key, pairs) for key, pairs in keys.items()}, merged


def _reduce(key: str, pairs: list[tuple[float, float]]) -> float:
    values = [v for v, _ in pairs]
    if key.endswith("loss") or key.endswith("_tokens"):
        return float(sum(values))
    if key.endswith("_max"):
        return float(max(values))
    total = sum(w for _, w in pairs)
    if total <= 0:  # nothing counted anywhere: each rank's value is the empty mean (0)
        return float(sum(values) / len(values))
    return float(sum(v * w for v, w in pairs) / total)


def _cost(sample: Any, uses_opd: bool) -> int:
    tokens = len(sample.prompt_token_ids) + len(sample.response_token_ids)
    teacher = min(len(sample.hints), 3) if uses_opd else 0
    return tokens * (1 + teacher)


def _buckets(params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Consecutive parameters of one dtype and device, at most ``BUCKET_ELEMENTS`` each."""
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        if bucket and (
            size + p.numel() > BUCKET_ELEMENTS
            or (p.dtype, p.device) != (bucket[0].dtype, bucket[0].device)
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += p.numel()
    if bucket:
        yield bucket


# ---- processes -------------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """Linux ``PR_SET_PDEATHSIG``: SIGKILL this worker when rank 0 exits, however it exits."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:  # rank 0 died before the line above
        os._exit(1)


def _cpu_threads(cfg: TrainerSettings) -> None:
    """Ranks on the CPU share its cores instead of each taking all of them."""
    if not _uses_cuda(cfg):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.nproc))


def _worker(rank: int, port: int, cfg: TrainerSettings, parent: int) -> None:
    """Ranks 1..N-1: load what rank 0 names, train each batch it sends, until ``stop``."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 stops the ranks together
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from pipeline.trainer import methods

    methods.load_plugins(cfg.plugins)  # an unpickled cfg skipped its validator, which loads them
    _cpu_threads(cfg)
    if _uses_cuda(cfg):
        torch.cuda.set_device(rank)
    store = dist.TCPStore(
        HOST, port, cfg.nproc, is_master=False, timeout=timedelta(seconds=cfg.dist_timeout_s)
    )
    group = RankGroup.connect(rank, cfg.nproc, store, backend_for(cfg), cfg.dist_timeout_s)
    core: TrainerCore | None = None
    while True:
        message = group.receive()
        if message[0] == "load":
            directory = None if message[1] is None else Path(message[1])
            core = group.load_core(cfg, directory, message[2])
        elif message[0] == "step":
            assert core is not None, "rank 0 sends a step only after a load"
            core.train_step(message[1], message[2], message[3])
        else:  # stop
            break
    group.close()


class _Watch:
    """Rank 0's watch over its workers: one that exits before ``stop`` ends every rank at once
    (rank 0 may be waiting for it in a collective that would only fail at the timeout)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.stopping = False
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="rank-watch", daemon=True).start()

    def _run(self) -> None:
        from multiprocessing.connection import wait

        wait([p.sentinel for p in self.workers])
        if not self.stopping:
            self.fail(self.dead(0))

    def dead(self, timeout: float | None) -> Any | None:
        """The first worker to exit within ``timeout`` seconds (None: however long)."""
        from multiprocessing.connection import wait

        ready = wait([p.sentinel for p in self.workers], timeout)
        if not ready:
            return None
        dead = next(p for p in self.workers if p.sentinel in ready)
        dead.join(timeout=5)  # its sentinel closes a moment before its status can be read
        return dead

    def fail(self, dead: Any | None) -> None:
        """Kill every worker and exit, saying which rank died: a restart resumes from the
        newest manifest (exiting mid-publish is safe, see the protocol)."""
        with self._lock:
            for p in self.workers:
                with contextlib.suppress(Exception):
                    p.kill()
            rank = "?" if dead is None else self.workers.index(dead) + 1
            status = None if dead is None else dead.exitcode
            os.write(
                2,
                (
                    f"liverl train: rank {rank} exited (status {status}): stopping every "
                    "rank; steps not published yet are trained again after a restart\n"
                ).encode(),
            )
            os._exit(1)


@contextlib.contextmanager
def spawn_ranks(cfg: TrainerSettings, echo: Callable[[str], None]) -> Iterator[RankGroup]:
    """This process as rank 0 of ``cfg.nproc`` ranks, the others spawned here; on exit they
    are told to stop (or killed, if rank 0 is leaving on an error)."""
    import torch.multiprocessing as mp

    world = cfg.nproc
    backend = backend_for(cfg)
    _cpu_threads(cfg)
    store = dist.TCPStore(
        HOST,
        0,
        world,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=cfg.dist_timeout_s),
    )
    ctx = mp.get_context("spawn")
    workers = [
        ctx.Process(
            target=_worker, args=(r, store.port, cfg, os.getpid()), name=f"liverl-train-rank{r}"
        )
        for r in range(1, world)
    ]
    for p in workers:
        p.start()
    watch = _Watch(workers)
    group: RankGroup | None = None
    clean = False
    try:
        group = RankGroup.connect(0, world, store, backend, cfg.dist_timeout_s)
        pids = [os.getpid(), *(p.pid for p in workers)]
        echo(f"distributed: {world} ranks, {backend} backend, pids {pids}")
        yield group
        clean = True
    except BaseException:
        # A collective failed because a worker died (gloo notices at once): say so, as the
        # watch would, instead of the collective's traceback.
        dead = watch.dead(5.0)
        if dead is not None:
            watch.fail(dead)
        raise
    finally:
        watch.stopping = True
        if clean and group is not None:
            group.send(("stop",))
            for p in workers:
                p.join(timeout=30)
        for p in workers:  # an error on rank 0, or a worker that did not stop
            if p.is_alive():
                p.kill()
            p.join()
        if group is not None:
            group.close()
