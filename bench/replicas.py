"""Cell checkpoints and standby replicas: their latency, their cost, and moves.

Every kernel's state is replicated by its cell checkpoints in the blob store
(``agent/checkpoints.py``); GPU workspaces under a replica policy also get warm
standbys on their other replica hosts (``control/standbys.py``), measured in parts 6
and 7 on a platform of their own. For every kernel, what NotebookOS calls
state-sync latency is measured as the **checkpoint latency**: from the cell's
execute_reply, as the client receives it, to the kernel's state being durable in the
blob store and recorded in the control plane's DB (the workspace row's
``snapshot.kernels[kernel].cell`` reaching that cell's execution count; the ON
platform's SQLite file is polled read-only every ``--poll-ms``).

Two platforms run side by side: ON (``nbfleet up``, checkpoints on, the default) and
OFF (``--no-cell-checkpoints``), both ``--idle-suspend 0 --warm-pool 0``.

1. Checkpoint latency of a small cell (``x_i = i``), ``--samples`` cells one at a
   time, each after the previous one's checkpoint: p50, p99, max
   (``checkpoint_small_*``).
2. The added cell latency (execute_request sent -> execute_reply received) of a small
   cell on ON against OFF, in alternating blocks of ``--block`` cells, in two modes:
   back-to-back (``added_b2b_*``: the next cell goes as soon as the reply arrives, so
   a checkpoint's flush can be ahead of it on the kernel's shell channel) and with
   ``--think-ms`` between cells (``added_think_*``). Blocks, not single cells,
   alternate so that back-to-back really is back-to-back on one kernel; after an ON
   block its last checkpoint is awaited, so that it does not run during the OFF block.
3. Checkpoint latency of a cell that makes 100 MB of new state
   (``big = os.urandom(100 << 20)``), ``--big-samples`` cells (with few samples p99 is
   about the max), and that heavy cell's own latency on ON against OFF, interleaved
   (``checkpoint_100mb_*``, ``cell_100mb_*``).
4. 1 and 2 again with the 100 MB value held in both kernels (figures suffixed
   ``_ns100mb``): a checkpoint checks every value the namespace holds, not only
   what the cell changed.
5. Move time on ON: a second agent joins, the embedded agent's host is drained
   (``POST /v1/admin/hosts/{host}/drain``) and the time from that call to the
   workspace ``running`` on the other host is taken, ``--moves`` times back and forth
   (the target undrained before each) with a small state (``v = 41``), then as many
   times with 100 MB of state: p50 and max, and split into the drain's reaction
   (the call to the workspace leaving ``running``: the control plane's fleet duties
   act on drains) and the move itself (from there to ``running`` on the other host),
   each to the 10 ms poll of ``GET /v1/workspaces/{ws}``. The state is checked
   after each move.

Then, after those two platforms are stopped (``--no-standby`` skips this,
``--only-standby`` runs only this), a replica platform: ``nbfleet up --policy nbfleet
--replicas 2 --gpus 1xA100-80GB --prewarm 0`` and a second agent joined before any
workspace is placed, so that a GPU workspace's kernel runs on one host and has a
standby on the other (a ``standby_replicas`` row).

6. Standby sync latency, NotebookOS's state-sync latency proper: from a cell's
   execute_reply to the standby row's ``staged[kernel]["cell"]`` reaching its
   execution count (written once the standby's kernel applied it), the DB polled
   as above, ``--samples`` small cells and
   ``--big-samples`` 100 MB cells, one at a time: ``standby_sync_<small|100mb>_*``;
   in the same poll loop the checkpoint latency (``standby_checkpoint_*``) and the
   difference, the standby's own share: download, verify, apply
   (``standby_staging_*``).
7. Moves to the standby's host: the GPU workspace's host drained, the time to
   ``running`` on the other host, its restore report's ``path`` (``_promoted``: how
   many were ``standby``) and ``seconds`` (``_restore_p50_ms``), ``--standby-moves``
   times with a small and with a 100 MB state: ``move_gpu_standby_<state>_*``. A
   drain takes the host out of the workspace's replicas (the scheduler drops it from
   its model), so each move is of a fresh GPU workspace, deleted after. Compared
   with a CPU workspace's moves on the same platform, back and forth, which with
   ``--prewarm 0`` start a kernel cold: ``move_cpu_cold_<state>_*``.

One JSON line per figure on stdout (``{"bench": "replicas", "figure", "value"}``); a
verdict on stderr against NotebookOS's sync (54.8 ms p50, 268 ms p99: the checkpoint
and the standby sync latencies) and the 2 ms added-latency target.

    .venv/bin/python bench/replicas.py
    .venv/bin/python bench/replicas.py --samples 200 --big-samples 10 --think-ms 100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from harness import (
    admin_headers,
    channels_url,
    grant_credits,
    measured,
    nbfleet_up,
    percentile,
    stderr,
    stop,
    tail,
    wait_for,
    workspace_kernel,
)
from nbfleet.sdk.kernel_socket import KernelSocket

BENCH = "replicas"
NOTEBOOKOS_P50_MS, NOTEBOOKOS_P99_MS = 54.8, 268.0
ADDED_TARGET_MS = 2.0
#: A checkpoint, or a move, not done after this long is a failure.
GIVE_UP_S = 120.0
BIG = "big = os.urandom(100 << 20)"
MS = 1000.0
#: Pause between undraining a host and draining the other.
SETTLE_S = 1.5
MICRO_CREDITS = 1_000_000
#: The states of the replica platform's moves: (set up, checked after each move).
STANDBY_MOVE_STATES = {
    "small": ("globals().pop('big', None)\nv = 41", "print(v)"),
    "100mb": (f"import os, hashlib\n{BIG}\ndigest = hashlib.sha256(big).hexdigest()",
              "print(hashlib.sha256(big).hexdigest())"),
}


@dataclass
class Side:
    """One platform's workspace and kernel."""

    name: str
    url: str
    home: Path
    sock: KernelSocket
    kernel: str
    workspace: str
    token: str

    @property
    def db(self) -> Path:
        return self.home / "nbfleet.db"


# ------------------------------------------------------------------ cells
async def cell(sock: KernelSocket, code: str) -> tuple[float, float, int]:
    """Run ``code``: (sent, reply received) on the perf_counter clock, and the
    reply's execution count. Does not wait for the kernel to go idle."""
    request = sock.message("execute_request", {
        "code": code, "silent": False, "store_history": True, "user_expressions": {},
        "allow_stdin": False, "stop_on_error": True}, "shell")
    msg_id = request["header"]["msg_id"]
    sent = time.perf_counter()
    await sock.send(request)
    deadline = sent + GIVE_UP_S
    while True:
        msg = await sock.receive(max(0.01, deadline - time.perf_counter()))
        if msg["channel"] == "shell" and msg["parent_header"].get("msg_id") == msg_id:
            received = time.perf_counter()
            content = msg["content"]
            if content.get("status") != "ok":
                raise RuntimeError(f"cell failed: {code[:60]!r}: {content}")
            return sent, received, int(content["execution_count"])


async def printed(sock: KernelSocket, code: str) -> str:
    result = await sock.execute(code, timeout=GIVE_UP_S)
    if result.status != "ok":
        raise RuntimeError(f"cell failed: {code[:60]!r}: {result.reply}")
    return result.stdout.strip()


# ------------------------------------------------------------------ the DB's record
def _entry(conn: sqlite3.Connection, side: Side) -> dict[str, Any] | None:
    row = conn.execute("SELECT snapshot FROM workspaces WHERE id = ?",
                       (side.workspace,)).fetchone()
    if row is None or not row[0]:
        return None
    snapshot = json.loads(row[0])
    entry = ((snapshot or {}).get("kernels") or {}).get(side.kernel)
    return entry if isinstance(entry, dict) else None


def recorded_entry(side: Side) -> dict[str, Any] | None:
    """The kernel's checkpoint record as the control plane's DB holds it now."""
    with contextlib.closing(sqlite3.connect(f"file:{side.db}?mode=ro", uri=True,
                                            timeout=5)) as conn:
        return _entry(conn, side)


class Poller:
    """Polls the DB until a cell's checkpoint is recorded; keeps the poll gaps."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self.gaps: list[float] = []

    def wait(self, side: Side, count: int, before: dict[str, Any] | None) -> float:
        """The perf_counter time the DB first showed a record newer than ``before``
        that includes cell ``count``."""
        with contextlib.closing(sqlite3.connect(f"file:{side.db}?mode=ro", uri=True,
                                                timeout=5)) as conn:
            deadline = time.perf_counter() + GIVE_UP_S
            last: float | None = None
            while True:
                entry = _entry(conn, side)
                now = time.perf_counter()
                if last is not None:
                    self.gaps.append(now - last)
                last = now
                if entry is not None and entry != before and int(entry.get("cell", -1)) >= count:
                    return now
                if now > deadline:
                    raise TimeoutError(f"cell {count} of {side.name} not checkpointed after "
                                       f"{GIVE_UP_S:.0f} s (last record {entry})")
                time.sleep(self.poll_s)


async def checkpointed(side: Side, code: str, poller: Poller) -> tuple[float, float]:
    """Run ``code`` on ``side``; (its cell latency, its checkpoint latency) in seconds."""
    before = await asyncio.to_thread(recorded_entry, side)
    sent, received, count = await cell(side.sock, code)
    durable = await asyncio.to_thread(poller.wait, side, count, before)
    return received - sent, durable - received


# ------------------------------------------------------------------ the agent's metrics
async def agent_metrics(side: Side) -> dict[str, float]:
    """The checkpoint metrics of the ON platform's embedded agent (empty if unreadable)."""
    secret = (side.home / "cluster-secret").read_text().strip()
    try:
        async with httpx.AsyncClient(base_url=side.url, timeout=10.0) as http:
            agents = (await http.get("/v1/admin/agents",
                                     headers=admin_headers(side.home))).json()["items"]
            text = (await http.get(f"{agents[0]['url']}/agent/v1/metrics",
                                   headers={"Authorization": f"Bearer {secret}"})).text
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("nbfleet_cell_checkpoint_seconds_sum",
                     "nbfleet_cell_checkpoint_seconds_count",
                     'nbfleet_cell_checkpoints_total{outcome="kept"}'):
            if line.startswith(name + " "):
                out[name.split("{")[0]] = float(line.split()[-1])
    return out


# ------------------------------------------------------------------ 1, 2: latency
async def small_latency(on: Side, samples: int, poller: Poller,
                        tag: str = "small") -> dict[str, float]:
    """Checkpoint latency of ``samples`` small cells; figures ``checkpoint_<tag>_*``."""
    for index in range(3):  # warm-up: the first checkpoint saves the whole namespace
        await checkpointed(on, f"warm_{index} = {index}", poller)
    poller.gaps.clear()
    metrics_before = await agent_metrics(on)
    lags = [(await checkpointed(on, f"x_{i} = {i}", poller))[1] for i in range(samples)]
    metrics_after = await agent_metrics(on)
    out = {
        f"checkpoint_{tag}_samples": float(samples),
        f"checkpoint_{tag}_p50_ms": statistics.median(lags) * MS,
        f"checkpoint_{tag}_p99_ms": percentile(lags, 99) * MS,
        f"checkpoint_{tag}_max_ms": max(lags) * MS,
        f"checkpoint_{tag}_poll_period_mean_ms": statistics.mean(poller.gaps) * MS,
    }
    count_name, sum_name = ("nbfleet_cell_checkpoint_seconds_count",
                            "nbfleet_cell_checkpoint_seconds_sum")
    if count_name in metrics_before and count_name in metrics_after:
        done = metrics_after[count_name] - metrics_before[count_name]
        if done > 0:
            # The agent's own clock: from its sight of the reply to the control plane's
            # answer (a mean: the histogram has no exact quantiles).
            out[f"checkpoint_{tag}_agent_mean_ms"] = (
                (metrics_after[sum_name] - metrics_before[sum_name]) / done * MS)
            out[f"checkpoint_{tag}_agent_count"] = done
    return out


async def big_latency(on: Side, off: Side, samples: int, poller: Poller) -> dict[str, float]:
    await checkpointed(on, "import os", poller)
    await cell(off.sock, "import os")
    lags, on_cells, off_cells = [], [], []
    for index in range(samples):
        took, lag = await checkpointed(on, BIG, poller)
        lags.append(lag)
        on_cells.append(took)
        sent, received, _ = await cell(off.sock, BIG)
        off_cells.append(received - sent)
        stderr.print(f"100 MB cell {index + 1}/{samples}: checkpoint {lag * MS:.0f} ms, "
                     f"cell ON {took * MS:.0f} ms, OFF {off_cells[-1] * MS:.0f} ms")
    on_median, off_median = statistics.median(on_cells) * MS, statistics.median(off_cells) * MS
    return {
        "checkpoint_100mb_samples": float(samples),
        "checkpoint_100mb_p50_ms": statistics.median(lags) * MS,
        "checkpoint_100mb_p99_ms": percentile(lags, 99) * MS,
        "checkpoint_100mb_max_ms": max(lags) * MS,
        "cell_100mb_on_median_ms": on_median,
        "cell_100mb_off_median_ms": off_median,
        "cell_100mb_added_median_ms": on_median - off_median,
    }


# ------------------------------------------------------------------ 3: added latency
async def added_latency(on: Side, off: Side, samples: int, block: int, think_s: float,
                        mode: str, poller: Poller) -> dict[str, float]:
    """ON against OFF cell latency; figures ``added_<mode>_*``."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    kept_before = (await agent_metrics(on)).get("nbfleet_cell_checkpoints_total")
    counter = 0
    for round_ in range((samples + block - 1) // block):
        for side in (on, off) if round_ % 2 == 0 else (off, on):
            before = await asyncio.to_thread(recorded_entry, side) if side is on else None
            count = 0
            for _ in range(min(block, samples - len(times[side.name]))):
                if think_s:
                    await asyncio.sleep(think_s)
                counter += 1
                sent, received, count = await cell(side.sock, f"n = {counter}")
                times[side.name].append(received - sent)
            if side is on:  # its last checkpoint must not run during the OFF block
                await asyncio.to_thread(poller.wait, on, count, before)
    kept_after = (await agent_metrics(on)).get("nbfleet_cell_checkpoints_total")
    on_median = statistics.median(times["on"]) * MS
    off_median = statistics.median(times["off"]) * MS
    out = {
        f"added_{mode}_on_median_ms": on_median,
        f"added_{mode}_off_median_ms": off_median,
        f"added_{mode}_median_ms": on_median - off_median,
        f"added_{mode}_on_p99_ms": percentile(times["on"], 99) * MS,
        f"added_{mode}_off_p99_ms": percentile(times["off"], 99) * MS,
        f"added_{mode}_within_target": float(on_median - off_median <= ADDED_TARGET_MS),
    }
    if kept_before is not None and kept_after is not None:
        # Back-to-back cells are coalesced: fewer checkpoints than cells.
        out[f"added_{mode}_checkpoints_per_cell"] = (kept_after - kept_before) / len(times["on"])
    return out


# ------------------------------------------------------------------ 4: moves
@contextlib.contextmanager
def extra_agent(url: str, home: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A second agent (host) joining the platform at ``url``; stopped on the way out."""
    state = home / "agent2"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBFLEET_")}
    env["NBFLEET_HOME"] = str(home)
    log = home / "agent2.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nbfleet.cli.main", "agent", "--control", url,
             "--home", str(home), "--state-dir", str(state), "--gpus", "1xA100-80GB",
             "--warm-pool", "0", "--drain-timeout", "0"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    except BaseException:
        stderr.print(f"agent2 log ({log}):\n{tail(log, 3000)}", markup=False)
        raise
    finally:
        stop(proc)


def agent_ids(url: str, home: Path) -> list[str]:
    try:
        got = httpx.get(f"{url}/v1/admin/agents", headers=admin_headers(home), timeout=5.0)
    except httpx.HTTPError:
        return []
    return [a["id"] for a in got.json()["items"]] if got.status_code == 200 else []


async def move(http: httpx.AsyncClient, side: Side,
               leaving: str) -> tuple[float, float, str, list[str]]:
    """Drain ``leaving`` (the workspace's host); (seconds from the call to the workspace
    running elsewhere, seconds from the call to its move starting, its new host, the
    states seen on the way)."""
    admin = admin_headers(side.home)
    start = time.perf_counter()
    drained = await http.post(f"/v1/admin/hosts/{leaving}/drain", headers=admin)
    if drained.status_code != 200:
        raise RuntimeError(f"drain of {leaving}: {drained.status_code} {drained.text}")
    seen: list[str] = []
    started: float | None = None
    deadline = start + GIVE_UP_S
    while True:
        got = await http.get(f"/v1/workspaces/{side.workspace}")
        now = time.perf_counter()
        if got.status_code != 200:  # e.g. 429: noted, and asked again
            seen.append(f"HTTP {got.status_code} {got.text[:100]} +{(now - start) * MS:.0f} ms")
            if now > deadline:
                raise RuntimeError(f"the drain of {leaving}: states {seen}")
            await asyncio.sleep(0.1)
            continue
        body = got.json()
        state = f"{body['state']}@{body.get('host_id')}"
        if body.get("last_error"):
            state += f" ({str(body['last_error'])[:200]})"
        if not seen or seen[-1].split(" +", 1)[0] != state:
            seen.append(f"{state} +{(now - start) * MS:.0f} ms")
        if started is None and (body["state"], body.get("host_id")) != ("running", leaving):
            started = now - start
        if body["state"] == "running" and body.get("host_id") not in (None, leaving):
            return now - start, started or 0.0, str(body["host_id"]), seen
        # A move keeps the desired state running (a failed placement is retried);
        # a drain with nowhere to go suspends the workspace.
        if body["desired_state"] == "suspended" or now > deadline:
            host = (await http.get(f"/v1/admin/hosts/{leaving}", headers=admin)).text
            raise RuntimeError(f"the drain of {leaving} did not move the workspace: states "
                               f"{seen}; host {host}")
        await asyncio.sleep(0.01)


async def moves(on: Side, poller: Poller, count: int) -> dict[str, float]:
    """``count`` moves back and forth with a small state, then ``count`` with 100 MB."""
    admin = admin_headers(on.home)
    states = {  # what the kernel is given, and how its state is checked after a move
        "small": ("del big\nv = 41", "print(v)"),
        "100mb": (f"{BIG}\nimport hashlib\ndigest = hashlib.sha256(big).hexdigest()",
                  "print(hashlib.sha256(big).hexdigest())"),
    }
    times: dict[str, list[float]] = {kind: [] for kind in states}
    reactions: dict[str, list[float]] = {kind: [] for kind in states}
    kept: dict[str, bool] = dict.fromkeys(states, True)
    async with httpx.AsyncClient(base_url=on.url, timeout=60.0,
                                 headers={"Authorization": f"Bearer {on.token}"}) as http:
        here = (await http.get(f"/v1/workspaces/{on.workspace}")).json()["host_id"]
        with extra_agent(on.url, on.home) as proc:
            await asyncio.to_thread(wait_for, lambda: len(agent_ids(on.url, on.home)) >= 2,
                                    proc, "the second agent")
            other = {here: next(a for a in agent_ids(on.url, on.home) if a != here)}
            other[other[here]] = here
            for kind, (setup, check) in states.items():
                await checkpointed(on, setup, poller)
                expected = await printed(on.sock, check)
                for index in range(count):
                    there = other[here]
                    # The host an earlier move drained takes work again.
                    undrained = await http.delete(f"/v1/admin/hosts/{there}/drain",
                                                  headers=admin)
                    if undrained.status_code != 200:
                        raise RuntimeError(f"undrain of {there}: {undrained.status_code} "
                                           f"{undrained.text}")
                    await on.sock.close()
                    # The undrain's wake ran the fleet's duties: a drain within
                    # DUTIES_EVERY_S of them would wait for the next tick instead.
                    await asyncio.sleep(SETTLE_S)
                    took, started, landed, seen = await move(http, on, here)
                    stderr.print(f"move {index + 1}/{count} ({kind} state): {took * MS:.0f} ms, "
                                 f"{here} -> {landed}, states {seen}")
                    on.sock = await KernelSocket.connect(
                        channels_url(on.url, on.workspace, on.kernel), on.token)
                    got = await printed(on.sock, check)
                    kept[kind] = kept[kind] and got == expected and landed == there
                    times[kind].append(took)
                    reactions[kind].append(started)
                    here = landed
            await on.sock.close()
    out: dict[str, float] = {"move_count": float(count)}
    for kind, spent in times.items():
        out[f"move_{kind}_p50_ms"] = statistics.median(spent) * MS
        out[f"move_{kind}_max_ms"] = max(spent) * MS
        # The drain's turn to be acted on (the fleet's duties), then the move itself.
        out[f"move_{kind}_reaction_p50_ms"] = statistics.median(reactions[kind]) * MS
        out[f"move_{kind}_moving_p50_ms"] = statistics.median(
            t - r for t, r in zip(spent, reactions[kind], strict=True)) * MS
        out[f"move_{kind}_state_ok"] = float(kept[kind])
    return out


# ------------------------------------------------------------------ 6, 7: standbys
def standby_rows(db: Path, workspace: str) -> dict[str, dict[str, Any]]:
    """The workspace's standby rows: host -> staged ``{kernel: {"key", "cell"}}``."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True,
                                            timeout=5)) as conn:
        return {host: json.loads(staged) if staged else {} for host, staged in conn.execute(
            "SELECT host_id, staged FROM standby_replicas WHERE workspace_id = ?",
            (workspace,))}


def _staged(conn: sqlite3.Connection, side: Side, host: str) -> dict[str, Any] | None:
    row = conn.execute("SELECT staged FROM standby_replicas WHERE workspace_id = ? "
                       "AND host_id = ?", (side.workspace, host)).fetchone()
    if row is None or not row[0]:
        return None
    entry = json.loads(row[0]).get(side.kernel)
    return entry if isinstance(entry, dict) else None


def _cell_of(entry: dict[str, Any] | None) -> int:
    cell = (entry or {}).get("cell")
    return cell if isinstance(cell, int) else -1


class SyncPoller(Poller):
    """Polls, in one loop, both the checkpoint's record and the standby's row."""

    def wait_both(self, side: Side, host: str, count: int) -> tuple[float, float]:
        """The perf_counter times the DB first showed cell ``count`` checkpointed and
        staged on ``host``'s standby."""
        with contextlib.closing(sqlite3.connect(f"file:{side.db}?mode=ro", uri=True,
                                                timeout=5)) as conn:
            deadline = time.perf_counter() + GIVE_UP_S
            durable: float | None = None
            staged: float | None = None
            last: float | None = None
            while True:
                entry = _entry(conn, side) if durable is None else None
                standby = _staged(conn, side, host) if staged is None else None
                now = time.perf_counter()
                if last is not None:
                    self.gaps.append(now - last)
                last = now
                if durable is None and _cell_of(entry) >= count:
                    durable = now
                if staged is None and _cell_of(standby) >= count:
                    staged = now
                if durable is not None and staged is not None:
                    return durable, staged
                if now > deadline:
                    raise TimeoutError(
                        f"cell {count} not {'staged' if durable else 'checkpointed'} after "
                        f"{GIVE_UP_S:.0f} s (checkpoint {entry}, standby on {host} {standby}; "
                        f"rows {standby_rows(side.db, side.workspace)})")
                time.sleep(self.poll_s)


async def workspace_body(http: httpx.AsyncClient, side: Side) -> dict[str, Any]:
    body: dict[str, Any] = (await http.get(f"/v1/workspaces/{side.workspace}")).json()
    return body


async def standby_ready(http: httpx.AsyncClient, side: Side, host: str,
                        timeout: float = GIVE_UP_S) -> bool:
    """Until ``host``'s standby has the kernel's latest checkpoint staged (the one
    the workspace's snapshot names); False after ``timeout``."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        key = ((await asyncio.to_thread(recorded_entry, side)) or {}).get("key")
        staged = (await asyncio.to_thread(standby_rows, side.db, side.workspace)).get(host)
        if key and ((staged or {}).get(side.kernel) or {}).get("key") == key:
            return True
        await asyncio.sleep(0.02)
    return False


async def sync_latency(side: Side, host: str, poller: SyncPoller, samples: int, code: str,
                       tag: str) -> dict[str, float]:
    """``samples`` cells one at a time; the checkpoint and the standby's staging of each,
    from its execute_reply: figures ``standby_sync_<tag>_*``, ``standby_checkpoint_<tag>_*``
    and ``standby_staging_<tag>_*`` (the standby after the checkpoint)."""
    poller.gaps.clear()
    synced, durable, staging = [], [], []
    for index in range(samples):
        _, received, count = await cell(side.sock, code.format(i=index))
        done, staged = await asyncio.to_thread(poller.wait_both, side, host, count)
        synced.append(staged - received)
        durable.append(done - received)
        staging.append(staged - done)
        if code == BIG:
            stderr.print(f"standby, 100 MB cell {index + 1}/{samples}: checkpoint "
                         f"{durable[-1] * MS:.0f} ms, staged {synced[-1] * MS:.0f} ms")
    out = {f"standby_sync_{tag}_samples": float(samples),
           f"standby_poll_period_mean_{tag}_ms": statistics.mean(poller.gaps) * MS}
    for name, lags in (("sync", synced), ("checkpoint", durable), ("staging", staging)):
        out[f"standby_{name}_{tag}_p50_ms"] = statistics.median(lags) * MS
        out[f"standby_{name}_{tag}_p99_ms"] = percentile(lags, 99) * MS
        out[f"standby_{name}_{tag}_max_ms"] = max(lags) * MS
    return out


@dataclass
class Moved:
    took: float
    reaction: float
    landed: str
    path: str | None
    restore_s: float | None
    kept: bool


async def one_move(http: httpx.AsyncClient, side: Side, here: str, check: str,
                   expected: str, label: str, what: str) -> Moved:
    """Drain ``here`` (the workspace's host), time the move, read its restore report,
    reconnect and check the state."""
    await side.sock.close()
    await asyncio.sleep(SETTLE_S)
    took, started, landed, seen = await move(http, side, here)
    body = await workspace_body(http, side)
    report = ((body.get("restore") or {}).get("kernels") or {}).get(side.kernel) or {}
    path = report.get("path")
    seconds = report.get("seconds")
    stderr.print(f"[{label}] {what}: {took * MS:.0f} ms, {here} -> {landed}, restore path "
                 f"{path} in {seconds} s, states {seen}", markup=False)
    side.sock = await KernelSocket.connect(
        channels_url(side.url, side.workspace, side.kernel), side.token)
    got = await printed(side.sock, check)
    return Moved(took, started, landed, path if isinstance(path, str) else None,
                 float(seconds) if isinstance(seconds, (int, float)) else None,
                 got == expected)


def move_figures(name: str, moved: list[Moved]) -> dict[str, float]:
    out = {f"{name}_p50_ms": statistics.median(m.took for m in moved) * MS,
           f"{name}_max_ms": max(m.took for m in moved) * MS,
           # The drain's turn to be acted on (the fleet's duties), then the move itself.
           f"{name}_reaction_p50_ms": statistics.median(m.reaction for m in moved) * MS,
           f"{name}_moving_p50_ms": statistics.median(m.took - m.reaction
                                                      for m in moved) * MS,
           f"{name}_state_ok": float(all(m.kept for m in moved))}
    restored = [m.restore_s for m in moved if m.restore_s is not None]
    if restored:
        out[f"{name}_restore_p50_ms"] = statistics.median(restored) * MS
    return out


async def cold_moves(http: httpx.AsyncClient, side: Side, hosts: tuple[str, str],
                     count: int, poller: Poller) -> dict[str, float]:
    """``count`` drain moves back and forth per state of a CPU workspace (no standby):
    figures ``move_cpu_cold_<state>_*``."""
    admin = admin_headers(side.home)
    other = {hosts[0]: hosts[1], hosts[1]: hosts[0]}
    out: dict[str, float] = {}
    here = str((await workspace_body(http, side))["host_id"])
    for kind, (setup, check) in STANDBY_MOVE_STATES.items():
        await checkpointed(side, setup, poller)
        expected = await printed(side.sock, check)
        moved: list[Moved] = []
        for index in range(count):
            there = other[here]
            undrained = await http.delete(f"/v1/admin/hosts/{there}/drain", headers=admin)
            if undrained.status_code != 200:
                raise RuntimeError(f"undrain of {there}: {undrained.status_code} "
                                   f"{undrained.text}")
            moved.append(await one_move(http, side, here, check, expected, "cpu_cold",
                                        f"move {index + 1}/{count} ({kind} state)"))
            moved[-1].kept = moved[-1].kept and moved[-1].landed == there
            here = moved[-1].landed
        out.update(move_figures(f"move_cpu_cold_{kind}", moved))
        # --prewarm 0: no warm kernel to take, each move starts one.
        out[f"move_cpu_cold_{kind}_cold_paths"] = float(sum(m.path == "cold" for m in moved))
    for host in hosts:
        await http.delete(f"/v1/admin/hosts/{host}/drain", headers=admin)
    out["move_cpu_cold_count"] = float(count)
    return out


async def gpu_workspace(url: str, home: Path, name: str) -> Side:
    sock, kernel, workspace, token = await workspace_kernel(
        url, home, name=name, resources={"gpus": 1, "gpu_types": ["A100-80GB"]})
    await grant_credits(url, home, name, 1000 * MICRO_CREDITS)
    return Side(name, url, home, sock, kernel, workspace, token)


async def with_standby(http: httpx.AsyncClient, side: Side, hosts: tuple[str, str],
                       poller: Poller) -> tuple[str, str, float]:
    """(executor, standby host, seconds from the first checkpoint to the standby
    holding it) of a new GPU workspace."""
    executor = str((await workspace_body(http, side))["host_id"])
    standby_host = hosts[1] if executor == hosts[0] else hosts[0]
    await checkpointed(side, "import os", poller)
    made = time.perf_counter()
    if not await standby_ready(http, side, standby_host, 60.0):
        rows = standby_rows(side.db, side.workspace)
        why = ("made before the kernel started, and never given it"
               if standby_host in rows and side.kernel not in rows[standby_host] else "")
        raise RuntimeError(f"no standby of kernel {side.kernel} on {standby_host} after "
                           f"60 s {why}: rows {rows}")
    return executor, standby_host, time.perf_counter() - made


async def promotions(url: str, home: Path, hosts: tuple[str, str], count: int,
                     poller: Poller, first: Side) -> dict[str, float]:
    """``count`` moves per state of a GPU workspace to its standby's host; figures
    ``move_gpu_standby_<state>_*``. A drain takes the host out of the workspace's
    replicas (the scheduler drops it from its model), so each move is of a fresh
    workspace (``first``, the sync latency's, is the first), deleted after."""
    admin = admin_headers(home)
    out: dict[str, float] = {}
    serial = 0
    for kind, (setup, check) in STANDBY_MOVE_STATES.items():
        moved: list[Moved] = []
        waits: list[float] = []
        for index in range(count):
            serial += 1
            side = first if serial == 1 else await gpu_workspace(url, home, f"gpu{serial}")
            async with httpx.AsyncClient(
                    base_url=url, timeout=60.0,
                    headers={"Authorization": f"Bearer {side.token}"}) as http:
                if serial > 1:
                    await with_standby(http, side, hosts, poller)
                executor = str((await workspace_body(http, side))["host_id"])
                standby_host = hosts[1] if executor == hosts[0] else hosts[0]
                await checkpointed(side, setup, poller)
                expected = await printed(side.sock, check)
                waited = time.perf_counter()
                if not await standby_ready(http, side, standby_host):
                    raise RuntimeError(f"the standby on {standby_host} did not get the "
                                       f"latest checkpoint: rows "
                                       f"{standby_rows(side.db, side.workspace)}")
                waits.append(time.perf_counter() - waited)
                done = await one_move(http, side, executor, check, expected, "gpu_standby",
                                      f"move {index + 1}/{count} ({kind} state)")
                done.kept = done.kept and done.landed == standby_host
                if done.path != "standby":
                    stderr.print(f"[gpu_standby] NOT promoted: restore "
                                 f"{(await workspace_body(http, side)).get('restore')}",
                                 markup=False)
                moved.append(done)
                await side.sock.close()
                await delete_workspace(http, side)
                undrained = await http.delete(f"/v1/admin/hosts/{executor}/drain",
                                              headers=admin)
                if undrained.status_code != 200:
                    raise RuntimeError(f"undrain of {executor}: {undrained.status_code} "
                                       f"{undrained.text}")
        name = f"move_gpu_standby_{kind}"
        out.update(move_figures(name, moved))
        out[f"{name}_promoted"] = float(sum(m.path == "standby" for m in moved))
        # From the state's cell to its checkpoint staged on the standby (the move waits).
        out[f"{name}_standby_wait_p50_ms"] = statistics.median(waits) * MS
    out["move_gpu_standby_count"] = float(count)
    return out


async def delete_workspace(http: httpx.AsyncClient, side: Side) -> None:
    """Delete the workspace and wait for it to be gone (its GPU free again)."""
    deleted = await http.delete(f"/v1/workspaces/{side.workspace}")
    if deleted.status_code not in (200, 202, 204):
        raise RuntimeError(f"delete: {deleted.status_code} {deleted.text}")
    deadline = time.perf_counter() + GIVE_UP_S
    while time.perf_counter() < deadline:
        got = await http.get(f"/v1/workspaces/{side.workspace}")
        if got.status_code == 404 or (got.status_code == 200
                                      and got.json().get("state") == "deleted"):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"workspace {side.workspace} not deleted")


async def standbys(args: argparse.Namespace, root: Path) -> dict[str, float]:
    """A replica platform (``--policy nbfleet --replicas 2``) of two 1-GPU hosts: a GPU
    workspace's standby sync latency, moves of GPU workspaces to their standby's host
    (promotions), then a CPU workspace's moves (cold: no standby) on the same platform."""
    home = root / "replicas"
    home.mkdir()
    poller = SyncPoller(args.poll_ms / MS)
    results: dict[str, float] = {}
    with nbfleet_up(home, "--policy", "nbfleet", "--replicas", "2", "--gpus", "1xA100-80GB",
                    "--idle-suspend", "0", "--warm-pool", "0", "--prewarm", "0",
                    "--rate-limit", "0") as url, \
            extra_agent(url, home) as proc:
        # The replica hosts are chosen at placement: both must be up before it.
        await asyncio.to_thread(wait_for, lambda: len(agent_ids(url, home)) >= 2, proc,
                                "the second agent")
        first, second = agent_ids(url, home)[:2]
        hosts = (first, second)
        gpu = await gpu_workspace(url, home, "gpu1")
        async with httpx.AsyncClient(base_url=url, timeout=60.0,
                                     headers={"Authorization": f"Bearer {gpu.token}"}) as http:
            executor, standby_host, ready = await with_standby(http, gpu, hosts, poller)
        stderr.print(f"standby on {standby_host} (executor {executor}) ready "
                     f"{ready * MS:.0f} ms after the first checkpoint")
        for index in range(3):  # warm-up
            await checkpointed(gpu, f"warm_{index} = {index}", poller)
        stderr.print("standby sync latency, small cells")
        results.update(await sync_latency(gpu, standby_host, poller, args.samples,
                                          "x_{i} = {i}", "small"))
        stderr.print("standby sync latency, 100 MB cells")
        results.update(await sync_latency(gpu, standby_host, poller, args.big_samples,
                                          BIG, "100mb"))
        if not args.standby_moves:
            await gpu.sock.close()
            return results
        stderr.print("moves of GPU workspaces to their standby's host (promotions)")
        results.update(await promotions(url, home, hosts, args.standby_moves, poller, gpu))
        cpu = Side("cpu", url, home, *(await workspace_kernel(url, home, name="cpu")))
        async with httpx.AsyncClient(base_url=url, timeout=60.0,
                                     headers={"Authorization": f"Bearer {cpu.token}"}) as http:
            stderr.print("moves of a CPU workspace (cold) on the same platform")
            results.update(await cold_moves(http, cpu, hosts, args.standby_moves, poller))
        await cpu.sock.close()
    return results


# ------------------------------------------------------------------ the whole run
async def run(args: argparse.Namespace, root: Path) -> dict[str, float]:
    results: dict[str, float] = {}
    if not args.only_standby:
        results.update(await checkpoints(args, root))
    if args.standby:
        # After the checkpoint platforms are stopped: the replica platform runs alone.
        stderr.print("standby replicas")
        results.update(await standbys(args, root))
    return results


async def checkpoints(args: argparse.Namespace, root: Path) -> dict[str, float]:
    """Parts 1 to 5: the checkpoint platforms, ON and OFF."""
    poller = Poller(args.poll_ms / MS)
    common = ("--idle-suspend", "0", "--warm-pool", "0")
    (root / "on").mkdir()
    (root / "off").mkdir()
    with nbfleet_up(root / "on", *common) as on_url, \
            nbfleet_up(root / "off", *common, "--no-cell-checkpoints") as off_url:
        (on_sock, on_kernel, on_ws, on_token), (off_sock, off_kernel, off_ws, off_token) = \
            await asyncio.gather(workspace_kernel(on_url, root / "on"),
                                 workspace_kernel(off_url, root / "off"))
        on = Side("on", on_url, root / "on", on_sock, on_kernel, on_ws, on_token)
        off = Side("off", off_url, root / "off", off_sock, off_kernel, off_ws, off_token)
        results: dict[str, float] = {"checkpoint_poll_ms": args.poll_ms}
        think_s = args.think_ms / MS
        # A namespace of a few small values first, then one that holds 100 MB.
        for namespace in ("", "_ns100mb"):
            if namespace:
                stderr.print("checkpoint latency, 100 MB cells")
                results.update(await big_latency(on, off, args.big_samples, poller))
            stderr.print(f"checkpoint latency, small cells{namespace}")
            results.update(await small_latency(on, args.samples, poller, f"small{namespace}"))
            for mode, think in (("b2b", 0.0), ("think", think_s)):
                stderr.print(f"added cell latency, {mode}{namespace}")
                results.update(await added_latency(on, off, args.samples, args.block, think,
                                                   f"{mode}{namespace}", poller))
        await off.sock.close()
        if args.moves:
            stderr.print("moves")
            results.update(await moves(on, poller, args.moves))
        else:
            await on.sock.close()
    return results


def verdict(results: dict[str, float], args: argparse.Namespace) -> str:
    parts = checkpoint_verdict(results, args) if "checkpoint_small_p50_ms" in results else []
    if "standby_sync_small_p50_ms" in results:
        parts += standby_verdict(results)
    return f"{BENCH}: " + " | ".join(parts)


def standby_verdict(results: dict[str, float]) -> list[str]:
    parts = []
    for tag, label in (("small", "small cell"), ("100mb", "100 MB cell")):
        p50, p99 = results[f"standby_sync_{tag}_p50_ms"], results[f"standby_sync_{tag}_p99_ms"]
        text = (f"standby sync ({label}; execute_reply -> applied on the standby) p50 "
                f"{p50:.1f} ms, p99 {p99:.1f} ms (checkpoint "
                f"{results[f'standby_checkpoint_{tag}_p50_ms']:.1f} ms + staging "
                f"{results[f'standby_staging_{tag}_p50_ms']:.1f} ms at the median)")
        if tag == "small":
            text += (f" vs NotebookOS {NOTEBOOKOS_P50_MS:g}/{NOTEBOOKOS_P99_MS:g} ms: p50 "
                     f"{'below' if p50 < NOTEBOOKOS_P50_MS else 'NOT below'}, p99 "
                     f"{'below' if p99 < NOTEBOOKOS_P99_MS else 'NOT below'}")
        parts.append(text)
    if "move_gpu_standby_count" in results:
        count = int(results["move_gpu_standby_count"])
        for kind in STANDBY_MOVE_STATES:
            gpu, cpu = f"move_gpu_standby_{kind}", f"move_cpu_cold_{kind}"
            promoted = int(results[f"{gpu}_promoted"])
            kept = results[f"{gpu}_state_ok"] and results.get(f"{cpu}_state_ok", 1.0)
            parts.append(
                f"move ({kind} state) GPU by promotion p50 {results[f'{gpu}_p50_ms']:.0f} ms "
                f"({results[f'{gpu}_moving_p50_ms']:.0f} ms once started, restore "
                f"{results.get(f'{gpu}_restore_p50_ms', float('nan')):.0f} ms; "
                f"{promoted}/{count} promoted) vs CPU cold "
                f"{results.get(f'{cpu}_p50_ms', float('nan')):.0f} ms "
                f"({results.get(f'{cpu}_moving_p50_ms', float('nan')):.0f} ms once started, "
                f"restore {results.get(f'{cpu}_restore_p50_ms', float('nan')):.0f} ms); "
                f"state {'kept' if kept else 'NOT kept'}")
    return parts


def checkpoint_verdict(results: dict[str, float], args: argparse.Namespace) -> list[str]:
    parts = []
    for namespace, label in (("", "small cell"), ("_ns100mb", "small cell, 100 MB held")):
        p50 = results[f"checkpoint_small{namespace}_p50_ms"]
        p99 = results[f"checkpoint_small{namespace}_p99_ms"]
        parts.append(
            f"checkpoint latency ({label}; execute_reply -> durable in the blob store and "
            f"recorded) p50 {p50:.1f} ms vs NotebookOS sync {NOTEBOOKOS_P50_MS:g}: "
            f"{'below' if p50 < NOTEBOOKOS_P50_MS else 'NOT below'}, p99 {p99:.1f} ms vs "
            f"{NOTEBOOKOS_P99_MS:g}: {'below' if p99 < NOTEBOOKOS_P99_MS else 'NOT below'}")
    parts.append(f"100 MB cell: p50 {results['checkpoint_100mb_p50_ms']:.0f} ms, "
                 f"max {results['checkpoint_100mb_max_ms']:.0f} ms")
    for namespace, held in (("", ""), ("_ns100mb", ", 100 MB held")):
        for mode, label in (("b2b", "back-to-back"), ("think", f"{args.think_ms:g} ms think")):
            added = results[f"added_{mode}{namespace}_median_ms"]
            parts.append(f"added cell latency ({label}{held}) {added:+.2f} ms at the median "
                         f"(target <= {ADDED_TARGET_MS:g}: "
                         f"{'met' if added <= ADDED_TARGET_MS else 'NOT met'})")
    if "move_count" in results:
        kept = results["move_small_state_ok"] and results["move_100mb_state_ok"]
        parts.append(f"move (drain -> running elsewhere) p50 {results['move_small_p50_ms']:.0f}"
                     f" ms small ({results['move_small_moving_p50_ms']:.0f} ms once started), "
                     f"{results['move_100mb_p50_ms']:.0f} ms with 100 MB "
                     f"({results['move_100mb_moving_p50_ms']:.0f} ms once started; "
                     f"state {'kept' if kept else 'NOT kept'})")
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=50,
                        help="small cells timed per figure and side (default: %(default)s)")
    parser.add_argument("--big-samples", type=int, default=6,
                        help="100 MB cells timed (default: %(default)s)")
    parser.add_argument("--block", type=int, default=5,
                        help="cells per alternating ON/OFF block for the added latency "
                             "(default: %(default)s)")
    parser.add_argument("--think-ms", type=float, default=200.0,
                        help="pause between cells in the think-time mode (default: %(default)s)")
    parser.add_argument("--poll-ms", type=float, default=1.0,
                        help="how often the control plane's DB is polled (default: %(default)s)")
    parser.add_argument("--moves", type=int, default=3,
                        help="moves timed per state, back and forth (0: none; "
                             "default: %(default)s)")
    parser.add_argument("--no-standby", dest="standby", action="store_false",
                        help="skip the standby replicas (parts 6 and 7)")
    parser.add_argument("--only-standby", action="store_true",
                        help="only the standby replicas (parts 6 and 7)")
    parser.add_argument("--standby-moves", type=int, default=2,
                        help="moves timed per state on the replica platform, of the GPU "
                             "workspace and of a CPU one (0: none; default: %(default)s)")
    args = parser.parse_args(argv)
    if args.only_standby and not args.standby:
        parser.error("--only-standby and --no-standby exclude each other")
    if args.standby_moves < 0:
        parser.error("need --standby-moves >= 0")
    if args.samples < 2 or args.big_samples < 2 or args.block < 1:
        parser.error("need --samples >= 2, --big-samples >= 2 and --block >= 1")
    if args.think_ms < 0 or args.poll_ms <= 0 or args.moves < 0:
        parser.error("need --think-ms >= 0, --poll-ms > 0 and --moves >= 0")
    results = measured(BENCH, lambda tmp: run(args, tmp))
    if results is None:
        return 130
    print(verdict(results, args), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
