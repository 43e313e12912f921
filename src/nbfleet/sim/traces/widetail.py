"""A synthetic month of a production notebook GPU cluster: wide tasks, heavy tails.

The Sensei family (``synthetic.py``) is fitted to the NotebookOS paper: mostly
1-GPU sessions, task durations capped at six hours, think times of minutes. The
production month issue 28 was measured on is harder for every replica policy, and
this family reproduces the properties it quotes (the trace itself stays outside
the project):

* Tasks per GPU width 1 / 4 / 8 at 49 / 20 / 31 %: each session draws its width
  with those weights and every task uses all of it (``GPU_MIX``).
* Task duration p50 5 min, p99 17 h (``TASK_DURATION_S``: log-linear between
  knots, ASSUMED p75 30 min, p90 2.5 h, p95 6 h, and 15 s to 72 h at the ends).
* Think time (a task's end to the next submit) p50 3 min, p90 35 min, 7.8 % of
  gaps over 1 h (``THINK_TIME_S``: ASSUMED p75 12 min, p99 10 h, 10 s to 36 h).
* About 30,000 tasks in a month (720 h): sessions arrive as a Poisson process at
  ``SESSIONS_PER_HOUR``, each with a geometric number of tasks of mean
  ``MEAN_TASKS``, run back to back from its start; a session ends after its last
  task and an ASSUMED closing idle of 10 min to 2 h. No task is submitted at or
  after ``hours``.

The physical lower bound (the sum of width x duration) is about 5 GPU-h per task,
near the measured month's 155,502 GPU-h for 30,909 tasks. Same arguments, same
trace: all randomness comes from one ``random.Random(seed)``.
"""

from __future__ import annotations

import math
import random

from nbfleet.sim.traces.model import Session, Task, Trace, TraceError
from nbfleet.sim.traces.quantiles import QuantileDistribution

MINUTE = 60.0
HOUR = 3600.0
MONTH_HOURS = 720.0

TASK_DURATION_S = QuantileDistribution((
    (0.0, 15.0), (0.5, 5 * MINUTE), (0.75, 30 * MINUTE), (0.9, 2.5 * HOUR),
    (0.95, 6 * HOUR), (0.99, 17 * HOUR), (1.0, 72 * HOUR),
))
THINK_TIME_S = QuantileDistribution((
    (0.0, 10.0), (0.5, 3 * MINUTE), (0.75, 12 * MINUTE), (0.9, 35 * MINUTE),
    (0.922, HOUR), (0.99, 10 * HOUR), (1.0, 36 * HOUR),
))
GPU_MIX: tuple[tuple[int, float], ...] = ((1, 0.49), (4, 0.20), (8, 0.31))
MEAN_TASKS = 30.0
#: About 30,000 tasks submitted in 720 h at seed 0 (``MEAN_TASKS`` per session).
SESSIONS_PER_HOUR = 1.55
CLOSING_IDLE_S = (10 * MINUTE, 2 * HOUR)


def widetail(hours: float = MONTH_HOURS, seed: int = 0, *,
             sessions_per_hour: float = SESSIONS_PER_HOUR,
             mean_tasks: float = MEAN_TASKS) -> Trace:
    """``hours`` of wide, heavy-tailed sessions; see the module docstring."""
    if not hours > 0 or not math.isfinite(hours):
        raise TraceError(f"hours must be positive, got {hours}")
    if not sessions_per_hour > 0 or not math.isfinite(sessions_per_hour):
        raise TraceError(f"the session arrival rate must be positive, got {sessions_per_hour}")
    if not mean_tasks >= 1 or not math.isfinite(mean_tasks):
        raise TraceError(f"mean_tasks must be at least 1, got {mean_tasks}")
    rng = random.Random(seed)
    horizon = hours * HOUR
    widths, weights = [g for g, _ in GPU_MIX], [w for _, w in GPU_MIX]
    sessions: list[Session] = []
    start = rng.expovariate(sessions_per_hour / HOUR)
    while start < horizon:
        gpus = rng.choices(widths, weights=weights)[0]
        count = 1 + math.floor(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / mean_tasks))
        tasks: list[Task] = []
        submit = start
        for index in range(count):
            if index:
                submit += THINK_TIME_S.sample(rng)
            if submit >= horizon:
                break
            tasks.append(Task(submit, TASK_DURATION_S.sample(rng), gpus))
            submit = tasks[-1].end_s
        end = (tasks[-1].end_s if tasks else start) + rng.uniform(*CLOSING_IDLE_S)
        sessions.append(Session(f"wide-{len(sessions):06d}", start, end, gpus,
                                tasks=tuple(tasks)))
        start += rng.expovariate(sessions_per_hour / HOUR)
    return Trace(tuple(sessions), f"synthetic:widetail(hours={hours:g},seed={seed})")
