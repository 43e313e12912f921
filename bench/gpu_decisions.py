"""GPU cells, part ``decisions``: the scheduler's binding decisions per second.

What it measures: the scheduling policies the control plane runs, each inside the
:class:`~nbfleet.control.fleet.scheduler.LiveScheduler` the control plane wraps it in,
with a large fleet open (hosts of 8 GPUs, GPU kernels of the synthetic Sensei trace's
mix, each of a tenant with a fair-share weight), while cells are bound (``acquire``)
and released on random kernels at a steady load, on one thread.

Why that way: the Effects is a no-op that only counts what it is asked to do, so the
figures are the scheduler's own cost (the live Effects' work per cell is the ledger's,
timed by the latency part of ``gpu_cells.py``); the clocks run only inside the
scheduler's calls, on wall and on this thread's CPU, so the driver's bookkeeping and a
busy machine do not count; kernels are opened once per load (adopted, not placed again,
where a later policy would place them alike) so each load starts from a fresh fleet;
and the loop runs inside an event loop because a queued cell awaits a future, as in
the control plane. Run through ``bench/gpu_cells.py`` (``--parts decisions``).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import random
import statistics
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness import percentile, stderr
from nbfleet.control.fleet.scheduler import Binding, LiveScheduler
from nbfleet.model.cluster import ResourceSpec
from nbfleet.policy.scheduling.adopt import adopt_kernel
from nbfleet.policy.scheduling.base import FleetPolicy
from nbfleet.policy.scheduling.decisions import KernelRequest, Migrated
from nbfleet.policy.scheduling.registry import make_policy
from nbfleet.sim.traces.synthetic import GPU_MIX

BENCH = "gpu_cells"
TARGET_DECISIONS_PER_S = 2000.0


@dataclass
class CountingEffects:
    """The scheduler's Effects as a recorder: nothing is carried out, calls are counted."""

    calls: Counter[str] = field(default_factory=Counter)

    def scale_out(self, count: int, reason: str) -> None:
        self.calls["scale_out"] += 1

    def scale_in(self, host_ids: tuple[str, ...]) -> None:
        self.calls["scale_in"] += 1

    def prewarm(self, host_id: str, count: int) -> None:
        self.calls["prewarm"] += 1

    def placements_changed(self) -> None:
        self.calls["placements_changed"] += 1

    def migrate(self, move: Migrated) -> None:
        self.calls["migrate"] += 1

    def cell_ended(self, task_id: str) -> None:
        self.calls["cell_ended"] += 1

    def kernel_closed(self, workspace_id: str) -> None:
        self.calls["kernel_closed"] += 1


def kernel_sizes(count: int, rng: random.Random) -> dict[str, int]:
    """GPUs per kernel, drawn from the synthetic Sensei trace's mix."""
    sizes, weights = [g for g, _ in GPU_MIX], [w for _, w in GPU_MIX]
    return {f"ws-{k:05d}": rng.choices(sizes, weights=weights)[0] for k in range(count)}


def tenant_of(workspace_id: str, tenants: int) -> tuple[str, float]:
    """The kernel's tenant (live: its project), in turn, and its fair-share weight
    (1, 2 or 4, as in ``jobs.py``)."""
    index = int(workspace_id.rsplit("-", 1)[1]) % tenants
    return f"project-{index:03d}", float(2 ** (index % 3))


def same_placement(a: FleetPolicy, b: FleetPolicy) -> bool:
    """Whether ``b`` would place kernels exactly where ``a`` does."""
    knobs = ("replicas", "sr_high_watermark", "sr_floor", "host_shape")
    return (type(a).place_kernel is type(b).place_kernel
            and all(getattr(a.config, k) == getattr(b.config, k) for k in knobs))


#: Where a policy placed each kernel, right after opening them all.
Placements = tuple[FleetPolicy, dict[str, tuple[str, ...]]]


def open_fleet(name: str, hosts: int, sizes: dict[str, int], tenants: int,
               reference: Placements | None) -> tuple[LiveScheduler, Placements, list[float]]:
    """The policy in a LiveScheduler, its hosts joined and its kernels open; its
    placements; and the seconds each ``open_kernel`` took (none when the
    ``reference`` placements were adopted, as they are if the policy would place
    kernels alike)."""
    scheduler = LiveScheduler(make_policy(name), CountingEffects())
    policy = scheduler.policy
    for index in range(hosts):
        scheduler.host_joined(f"host-{index:04d}", policy.config.host_shape)
    if reference is not None and same_placement(reference[0], policy):
        for workspace_id, gpus in sizes.items():
            tenant, weight = tenant_of(workspace_id, tenants)
            policy.fair.weights[tenant] = weight  # as LiveScheduler.rebuild does
            adopt_kernel(policy, KernelRequest(workspace_id, ResourceSpec(gpus=gpus),
                                               tenant=tenant),
                         reference[1][workspace_id], now=scheduler.now())
        return scheduler, reference, []
    open_s: list[float] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=True) as progress:
        task = progress.add_task(f"{name}: opening kernels", total=len(sizes))
        for workspace_id, gpus in sizes.items():
            start = time.perf_counter()
            where = scheduler.open_kernel(workspace_id, ResourceSpec(gpus=gpus),
                                          *tenant_of(workspace_id, tenants))
            open_s.append(time.perf_counter() - start)
            if where is None:
                raise RuntimeError(f"{name}: kernel {workspace_id} ({gpus} GPUs) found no "
                                   f"hosts; use fewer --kernels or more --hosts")
            progress.advance(task)
    placed = {k: tuple(v.hosts) for k, v in policy.kernels.items()}
    return scheduler, (policy, placed), open_s


@dataclass
class Block:
    bound: int = 0
    #: Wall and CPU (this thread's) time inside the scheduler's calls.
    scheduler_ns: int = 0
    scheduler_cpu_ns: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    bind_ns: list[int] = field(default_factory=list)
    release_ns: list[int] = field(default_factory=list)
    #: Cells waiting in the policy's queue, summed over the releases.
    waiting_sum: int = 0
    paths: Counter[str] = field(default_factory=Counter)


def clocks() -> tuple[int, int]:
    return time.perf_counter_ns(), time.thread_time_ns()


def since(start: tuple[int, int]) -> tuple[int, int]:
    """Wall and CPU nanoseconds since ``start`` (from :func:`clocks`)."""
    return time.perf_counter_ns() - start[0], time.thread_time_ns() - start[1]


class CellDriver:
    """Cells on random idle kernels, bound and released as the cell gate does it,
    keeping ``target`` GPUs committed or asked for."""

    def __init__(self, scheduler: LiveScheduler, sizes: dict[str, int], target: int,
                 rng: random.Random) -> None:
        self.scheduler = scheduler
        self.sizes = sizes
        self.target = target
        self.rng = rng
        self.idle = list(sizes)
        self.running: list[tuple[str, str]] = []  # (task id, workspace id)
        self.waiting: dict[str, tuple[Coroutine[Any, Any, Binding], asyncio.Future[Any],
                                      str]] = {}
        self.committed = 0
        self.queued = 0
        self.seq = 0
        self.block = Block()

    def step(self) -> None:
        if self.committed + self.queued < self.target and self.idle:
            self.submit()
        else:
            self.release()

    def run(self, cells: int, seconds: float) -> Block:
        """Until ``cells`` cells are bound or ``seconds`` have passed."""
        self.block = block = Block()
        wall, cpu = time.perf_counter(), time.thread_time()
        deadline = wall + seconds
        while block.bound < cells and time.perf_counter() < deadline:
            self.step()
        block.wall_s = time.perf_counter() - wall
        block.cpu_s = time.thread_time() - cpu
        return block

    def submit(self) -> None:
        index = self.rng.randrange(len(self.idle))
        self.idle[index], self.idle[-1] = self.idle[-1], self.idle[index]
        workspace_id = self.idle.pop()
        self.seq += 1
        task_id = f"{workspace_id}/{self.seq}"
        acquiring = self.scheduler.acquire(task_id, workspace_id, self.sizes[workspace_id])
        start = clocks()
        try:
            future = acquiring.send(None)
        except StopIteration as bound:
            spent = since(start)
            self._bound(bound.value, workspace_id)
        else:  # it waits in the policy's queue: a later release starts it
            spent = since(start)
            self.waiting[task_id] = (acquiring, future, workspace_id)
            self.queued += self.sizes[workspace_id]
            self.block.paths["queued"] += 1
        self.block.bind_ns.append(spent[0])
        self._count(spent)

    def release(self) -> None:
        index = self.rng.randrange(len(self.running))
        self.running[index], self.running[-1] = self.running[-1], self.running[index]
        task_id, workspace_id = self.running.pop()
        start = clocks()
        self.scheduler.release(task_id)
        wall, cpu = since(start)
        self.committed -= self.sizes[workspace_id]
        self.idle.append(workspace_id)
        self.block.waiting_sum += len(self.waiting)
        if self.waiting:  # the cells this release started wake up (their _bound)
            for waiting_id in [t for t, (_, f, _) in self.waiting.items() if f.done()]:
                acquiring, _, waiter = self.waiting.pop(waiting_id)
                start = clocks()
                try:
                    acquiring.send(None)
                except StopIteration as bound:
                    woke = since(start)
                    wall, cpu = wall + woke[0], cpu + woke[1]
                    self.queued -= self.sizes[waiter]
                    self._bound(bound.value, waiter)
        self.block.release_ns.append(wall)
        self._count((wall, cpu))

    def _count(self, spent: tuple[int, int]) -> None:
        self.block.scheduler_ns += spent[0]
        self.block.scheduler_cpu_ns += spent[1]

    def _bound(self, binding: Binding, workspace_id: str) -> None:
        self.running.append((binding.task_id, workspace_id))
        self.committed += len(binding.gpu_indices)
        self.block.bound += 1
        self.block.paths[binding.path.value] += 1


def profile_block(driver: CellDriver, cells: int, seconds: float) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    driver.run(cells, seconds)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    return out.getvalue()


def measure_policy(scheduler: LiveScheduler, sizes: dict[str, int], load: float,
                   args: argparse.Namespace, label: str) -> dict[str, float]:
    gpus = sum(len(h.gpus) for h in scheduler.policy.hosts.values())
    driver = CellDriver(scheduler, sizes, int(load * gpus), random.Random(args.seed))
    while driver.committed + driver.queued < driver.target:  # fill the fleet
        driver.submit()
    driver.run(args.warmup_cells, args.block_seconds)
    blocks = [driver.run(args.block_cells, args.block_seconds) for _ in range(args.blocks)]
    rates = [b.bound / (b.scheduler_ns / 1e9) for b in blocks]
    cpu_rates = [b.bound / (b.scheduler_cpu_ns / 1e9) for b in blocks]
    bind_us = [ns / 1000 for b in blocks for ns in b.bind_ns]
    release_us = [ns / 1000 for b in blocks for ns in b.release_ns]
    paths: Counter[str] = sum((b.paths for b in blocks), Counter())
    starts = sum(paths.values()) - paths["queued"]
    snapshot = scheduler.snapshot()
    result = {
        "decisions_per_s": statistics.median(rates),
        "decisions_per_s_min": min(rates),
        "decisions_per_cpu_s": statistics.median(cpu_rates),
        "wall_per_s": statistics.median(b.bound / b.wall_s for b in blocks),
        "cpu_share": sum(b.cpu_s for b in blocks) / sum(b.wall_s for b in blocks),
        "bind_p50_us": statistics.median(bind_us),
        "bind_p99_us": percentile(bind_us, 99),
        "release_p50_us": statistics.median(release_us),
        "release_p99_us": percentile(release_us, 99),
        "local": paths["local"] / starts,
        "migrate": (paths["migrate_warm"] + paths["migrate_cold"]) / starts,
        "queued": paths["queued"] / sum(paths.values()),
        "queue_mean": sum(b.waiting_sum for b in blocks) / len(release_us),
        "cells_timed": sum(b.bound for b in blocks),
        "committed_gpus": snapshot.committed_gpus,
        "queued_cells": snapshot.queued,
    }
    verdict = "met" if result["decisions_per_s"] >= TARGET_DECISIONS_PER_S else "NOT met"
    stderr.print(
        f"{BENCH}: {label}: {result['decisions_per_s']:,.0f} decisions/s (median of "
        f"{args.blocks} blocks, min {result['decisions_per_s_min']:,.0f}; "
        f"{result['decisions_per_cpu_s']:,.0f} per CPU second; "
        f"{result['wall_per_s']:,.0f}/s with the driver), bind p50/p99 "
        f"{result['bind_p50_us']:.0f}/{result['bind_p99_us']:.0f} µs, release "
        f"{result['release_p50_us']:.0f}/{result['release_p99_us']:.0f} µs; local "
        f"{result['local']:.1%}, migrate {result['migrate']:.1%}, queued "
        f"{result['queued']:.1%} (queue {result['queue_mean']:.1f} cells on average) | "
        f"target >= {TARGET_DECISIONS_PER_S:,.0f}/s: {verdict}",
        highlight=False)
    if args.profile or verdict != "met":
        stderr.print(f"{BENCH}: {label}: profile of one block (by own time):\n"
                     f"{profile_block(driver, args.block_cells, args.block_seconds)}", markup=False,
                     highlight=False)
    return result


async def run_decisions(args: argparse.Namespace) -> dict[str, float]:
    """Inside an event loop, as in the control plane (a queued cell awaits a future)."""
    sizes = kernel_sizes(args.kernels, random.Random(args.seed))
    result: dict[str, float] = {"hosts": args.hosts, "kernels": args.kernels,
                                "kernel_gpus": sum(sizes.values()), "tenants": args.tenants}
    reference: Placements | None = None
    for name in args.policies:
        for index, load in enumerate(args.load):
            # Each load on a freshly opened fleet: no cells left running, no moves.
            start = time.perf_counter()
            scheduler, reference, open_s = open_fleet(name, args.hosts, sizes, args.tenants,
                                                      reference)
            if index == 0:
                stderr.print(f"{BENCH}: {name}: {args.hosts} hosts, {args.kernels} kernels "
                             f"open in {time.perf_counter() - start:.1f} s"
                             + ("" if open_s else " (placements adopted)"), highlight=False)
            if open_s:
                ms = [s * 1000 for s in open_s]
                fullest = ms[-max(1, len(ms) // 10):]
                result |= {f"{name}_open_kernel_p50_ms": statistics.median(ms),
                           f"{name}_open_kernel_last10pct_p50_ms": statistics.median(fullest),
                           f"{name}_open_kernel_p99_ms": percentile(ms, 99)}
            label = f"{name}_load{round(load * 100)}"
            for figure, value in measure_policy(scheduler, sizes, load, args, label).items():
                result[f"{label}_{figure}"] = value
    return result
