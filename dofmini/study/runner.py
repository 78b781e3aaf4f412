"""The runner: the one executor of the pipeline (pipeline.py), which is written once and run twice.
In plan mode each stage returns its saved result, or PENDING, and records whether it is done and
the work it still needs (estimate.py prices it); nothing is computed or written. In run mode each
stage computes what is missing, and its first call prints which stage of the plan's it is, the
run's elapsed time and the estimated time left. A stage is a name; a name may cover several
files (a student: its tensors, its evaluation, its end-to-end KL), called one after another."""

import time
from collections import Counter
from dataclasses import dataclass, field

from . import store
from .progress import duration


class Pending:
    """What plan mode returns for a result not saved yet; a key that needs it is None."""

    def __repr__(self):
        return "PENDING"


PENDING = Pending()


@dataclass
class Row:
    """A stage in the plan: whether every file of it is saved, why the first one saved is made
    again (store.lookup's line), the work left (Counter of estimate.py's kinds), and the layer
    units it trains (None: not known before its dims)."""

    name: str
    done: bool = True
    why: str | None = None
    work: Counter = field(default_factory=Counter)
    units: int | None = 0


class Runner:
    """Plan mode without `plan`; run mode with the plan's rows and {name: estimated seconds}."""

    def __init__(self, plan: list | None = None, seconds: dict | None = None):
        self.planning = plan is None
        self.names = [row.name for row in plan or []]
        self.seconds = seconds or {}
        self.rows = {}  # name: Row, in the order called
        self.planned = set()  # plan mode: the layer units that stages planned so far train
        self.t0 = time.time()

    def stage(self, name, path, key, compute, work=(), valid=None, split=False, then=None):
        """The result saved at `path` with `key` (None: not known yet), checked by `valid`. Plan
        mode: it, or PENDING with `work` recorded: {kind: count} or a function that returns it,
        "units" the layer units it trains (None: unknown yet). Run mode: it, else compute() saved
        there (store.load_or_compute; `split`: every rank shares the work), then then(result)."""
        row = self._row(name)
        if self.planning:
            found, why = (None, None) if key is None else store.lookup(path, key, valid)
            if found is None:
                row.done = False
                row.why = row.why or why
                work = dict(work() if callable(work) else work)
                units = work.pop("units", 0)  # counted, not priced
                row.units = None if units is None or row.units is None else row.units + units
                row.work.update(work)
            return PENDING if found is None else found
        result = store.load_or_compute(path, key, compute, split, valid)
        if then:
            then(result)
        return result

    def log(self, message: str):
        """A line of what a stage found: run mode only (a plan says only what it plans)."""
        if not self.planning:
            store.log(message)

    def _row(self, name: str) -> Row:
        if name not in self.rows:
            self.rows[name] = Row(name)
            if not self.planning:
                self._begin(name)
        return self.rows[name]

    def _begin(self, name: str):
        """The stage's progress line: which of the plan's, and the wall time since the run began
        ("run: 3 min 05 s elapsed"); with estimates, also the time estimated from now to the end
        ("~25 min left"): this stage's and every later one's, summed unscaled (a resumed run skips
        its saved stages in no time, so their times say nothing of the estimates' scale)."""
        times = f"run: {duration(time.time() - self.t0)} elapsed"
        where = self.names.index(name) if name in self.names else len(self.names)
        if self.seconds:
            ahead = sum(self.seconds.get(n, 0.0) for n in self.names[where:])
            times += f", ~{duration(ahead)} left"
        store.log(f"[{where + 1}/{len(self.names)}] {name} ({times})")
