"""Drive a gateway with a workload: closed loop (AgentX rules) or open loop (trace timestamps).

Closed loop: `concurrency` lanes; each lane takes the next session tree, replays it (turn k+1
is sent `delay_s` after turn k ends; subagents start after their parent turn and a parent turn
waits for the subagents that join it), and takes the next tree when the whole tree has drained.
Open loop: every turn is sent at its trace time (session start + arrival), whatever is in flight.

Both are bounded: at `duration_s` no new request starts; requests still in flight get
`grace_s` to finish and are then cancelled (recorded as cancelled, excluded from metrics).
Requests that start before `warmup_s` are sent but excluded from the measured window.
A request refused for context length ends its session (its later turns are longer still);
any other error is recorded and the session goes on, as in AgentX. A 429 is sent again after
its Retry-After (at most MAX_BACKOFF_S), up to `max_retries` times, as the OpenAI client
does (its default is 2 retries, honouring Retry-After); each attempt is its own record, so a
refusal counts as an error and the attempt that is served is measured from its own start.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field

import httpx

from baton.bench.client import RequestRecord, is_context_overflow, send
from baton.bench.prepare import KEY_TOKENS, PreparedSession, PreparedTurn, Preparer
from baton.bench.workload import Session


MAX_BACKOFF_S = 30.0  # the longest Retry-After a lane waits before sending again


@dataclass(frozen=True)
class RunConfig:
    url: str
    model: str
    mode: str = "closed"             # "closed" | "open"
    concurrency: int = 4
    duration_s: float = 60.0
    warmup_s: float = 0.0
    grace_s: float = 10.0
    session_rate: float = 1.0        # open loop: sessions/s for sessions without a start time
    request_timeout_s: float = 600.0
    progress: bool = True
    seed: int = 0
    max_retries: int = 2             # a 429 is retried after its Retry-After this many times

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode must be closed or open, got {self.mode!r}")
        if self.concurrency < 1 or self.duration_s <= 0 or self.warmup_s < 0:
            raise ValueError("need concurrency ≥ 1, duration > 0, warmup ≥ 0")
        if self.warmup_s >= self.duration_s:
            raise ValueError("warmup must be shorter than the duration")
        if self.max_retries < 0:
            raise ValueError("max_retries must be ≥ 0")


@dataclass
class RunResult:
    records: list[RequestRecord]
    warmup_s: float
    end_s: float
    sessions_started: int = 0
    sessions_finished: int = 0
    t0: float = 0.0                  # time.perf_counter() at the run clock's zero
    extra: dict = field(default_factory=dict)


class _Run:
    """Shared state of one run: client, clock, records, the global prefix set, the stop flag."""

    def __init__(self, cfg: RunConfig, client: httpx.AsyncClient):
        self.cfg, self.client = cfg, client
        self.t0 = time.perf_counter()
        self.records: list[RequestRecord] = []
        self.seen_keys: set[int] = set()
        self.closed = asyncio.Event()
        self.started = self.finished = 0

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    async def sleep(self, seconds: float) -> None:
        """Sleep, but wake up at once when the run closes."""
        if seconds > 0 and not self.closed.is_set():
            try:
                await asyncio.wait_for(self.closed.wait(), seconds)
            except TimeoutError:
                pass

    def _global_hit(self, pt: PreparedTurn) -> int:
        n = 0
        for key in pt.keys:
            if key not in self.seen_keys:
                break
            n += 1
        self.seen_keys.update(pt.keys)
        return min(n * KEY_TOKENS, max(pt.prompt_tokens - 1, 0))

    async def send(self, ps: PreparedSession, i: int) -> RequestRecord:
        """Send turn i; a 429 again after its Retry-After, up to max_retries times, while
        the run is open (the module docstring)."""
        pt = ps.turns[i]
        hit = self._global_hit(pt)
        for attempt in range(self.cfg.max_retries + 1):
            rec = await send(self.client, self.cfg.model, pt, ps.session_id, i, self.clock,
                             self.records, hit)
            if rec.retry_after is None or attempt == self.cfg.max_retries:
                return rec
            await self.sleep(min(rec.retry_after, MAX_BACKOFF_S))
            if self.closed.is_set():
                return rec
        return rec

    async def run_tree(self, ps: PreparedSession) -> None:
        """Replay one session tree (turns in order, subagents as concurrent tasks)."""
        by_after: dict[int, list] = defaultdict(list)
        for child, kid in ps.children:
            by_after[child.after_turn].append((child, kid))
        joins: dict[int, list[asyncio.Task]] = defaultdict(list)
        async with asyncio.TaskGroup() as tg:
            def spawn(after: int) -> None:
                for child, kid in by_after[after]:
                    task = tg.create_task(self._child(child.delay_s, kid))
                    if child.join_turn is not None:
                        joins[child.join_turn].append(task)
            spawn(-1)
            for i, pt in enumerate(ps.turns):
                if joins[i]:
                    await asyncio.wait(joins[i])
                if i:
                    await self.sleep(pt.turn.delay_s)
                if self.closed.is_set():
                    break
                rec = await self.send(ps, i)
                if is_context_overflow(rec.error):
                    break  # every later turn is longer still
                spawn(i)

    async def _child(self, delay: float, kid: PreparedSession) -> None:
        await self.sleep(delay)
        if not self.closed.is_set():
            await self.run_tree(kid)


def _status(run: _Run) -> str:
    done = [r for r in run.records if r.end is not None]
    errors = sum(1 for r in done if r.error)
    return f"ok={len(done) - errors} err={errors} live={len(run.records) - len(done)}"


async def _ticker(run: _Run, horizon: float) -> None:
    """Progress over the run's time budget: a bar on a terminal, a line every 10 s otherwise."""
    import sys

    from tqdm import tqdm

    desc = f"{run.cfg.mode} c={run.cfg.concurrency}"
    if not sys.stderr.isatty():
        while True:
            await asyncio.sleep(10.0)
            print(f"[bench] {desc} {run.clock():.0f}/{horizon:.0f}s {_status(run)}",
                  file=sys.stderr, flush=True)
    with tqdm(total=round(horizon), unit="s", desc=desc,
              bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total}s {postfix}") as bar:
        while True:
            bar.n = min(run.clock(), horizon)
            bar.set_postfix_str(_status(run), refresh=False)
            bar.refresh()
            await asyncio.sleep(0.5)


async def _finish(run: _Run, tasks: list[asyncio.Task]) -> float:
    """Wait until every task is done or the deadline; then close, give grace, cancel."""
    cfg = run.cfg
    if tasks:
        await asyncio.wait(tasks, timeout=max(cfg.duration_s - run.clock(), 0))
    run.closed.set()
    pending = [t for t in tasks if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=cfg.grace_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return run.clock()


async def _closed(run: _Run, sessions: list[Session], preparer: Preparer) -> list[asyncio.Task]:
    queue = iter(enumerate(sessions))

    async def lane() -> None:
        for index, session in queue:
            if run.closed.is_set() or run.clock() >= run.cfg.duration_s:
                return
            prepared = await asyncio.to_thread(preparer.prepare, session, index)
            run.started += 1
            await run.run_tree(prepared)
            run.finished += 1

    return [asyncio.create_task(lane()) for _ in range(run.cfg.concurrency)]


def open_schedule(sessions: list[Session], rate: float, seed: int) -> list[float]:
    """Start time of each session: its trace start, or Poisson arrivals at `rate` per second."""
    rng = random.Random(seed)
    starts, clock = [], 0.0
    for s in sessions:
        if s.start_s is None:
            starts.append(clock)
            clock += rng.expovariate(rate)
        else:
            starts.append(s.start_s)
    first = min(starts, default=0.0)
    return [t - first for t in starts]


def _flat_events(ps: PreparedSession, start: float) -> list[tuple[float, PreparedSession, int]]:
    out = [(start + pt.turn.arrival_s, ps, i) for i, pt in enumerate(ps.turns)]
    for _, kid in ps.children:
        out += _flat_events(kid, start)
    return out


async def _open(run: _Run, sessions: list[Session], preparer: Preparer) -> list[asyncio.Task]:
    starts = open_schedule(sessions, run.cfg.session_rate, run.cfg.seed)
    chosen = [(t, i, s) for i, (t, s) in enumerate(zip(starts, sessions))
              if t < run.cfg.duration_s]
    prepared = await asyncio.to_thread(lambda: [(t, preparer.prepare(s, i)) for t, i, s in chosen])
    run.started = len(prepared)
    events = sorted((e for t, ps in prepared for e in _flat_events(ps, t)), key=lambda e: e[0])
    run.t0 = time.perf_counter()  # the clock starts after preparation
    tasks = []
    for at, ps, i in events:
        if at >= run.cfg.duration_s:
            break
        await run.sleep(at - run.clock())
        tasks.append(asyncio.create_task(run.send(ps, i)))
    return tasks


async def run_workload(cfg: RunConfig, sessions: list[Session], preparer: Preparer) -> RunResult:
    """Replay `sessions` against `cfg.url` and return every request's record."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=cfg.url, timeout=timeout, limits=limits) as client:
        run = _Run(cfg, client)
        ticker = asyncio.create_task(_ticker(run, cfg.duration_s)) if cfg.progress else None
        try:
            if cfg.mode == "closed":
                tasks = await _closed(run, sessions, preparer)
            else:
                scheduler = asyncio.create_task(_open(run, sessions, preparer))
                await asyncio.wait([scheduler], timeout=cfg.duration_s + 3600)
                tasks = scheduler.result()
            end = await _finish(run, tasks)
        finally:
            if ticker:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)
    if cfg.mode == "open":
        run.finished = run.started
    return RunResult(run.records, cfg.warmup_s, end, run.started, run.finished, run.t0)
