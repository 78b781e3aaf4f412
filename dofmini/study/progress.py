"""Progress of a run's long loops, shown one way for all of them: a bar on a terminal, else a plain
line at most every EVERY seconds (a log file, a pipe). Time labels mean one thing everywhere:
"elapsed" is the wall time since the start of what the line names (the run, on a stage's line; the
loop, on a loop's line), "left" the estimated wall time from now to its end."""

import sys
import time

from tqdm import tqdm

EVERY = 30.0  # seconds between plain progress lines


def duration(seconds: float) -> str:
    """A wall time for a person: "41 s", "3 min 05 s", "2 h 07 min"."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


class Progress:
    """`what`'s progress through `total` `unit`s, as a context manager: update(n) after each n.
    On a terminal a tqdm bar; otherwise, once `every` seconds (default EVERY) have passed since
    the loop began or since its last line, a line "what: 37/128 windows, 41 s elapsed, ~98 s left"
    (left: at the mean pace so far)."""

    def __init__(self, what: str, total: int, unit: str, every: float | None = None):
        self.what = what
        self.total = total
        self.unit = unit
        self.done = 0
        self.every = EVERY if every is None else every
        self.start = self.last = time.time()
        # sys.stdout as it is now: torchrun's other ranks write to os.devnull (devices.start)
        terminal = sys.stdout.isatty()
        bar = dict(total=total, desc=what, unit=f" {unit}", file=sys.stdout, leave=False)
        self.bar = tqdm(**bar) if terminal else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()

    def update(self, n: int):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.time()
        if now - self.last < self.every:
            return
        self.last, elapsed = now, now - self.start
        left = elapsed / self.done * (self.total - self.done)
        counted = f"{self.done}/{self.total} {self.unit}"
        times = f"{duration(elapsed)} elapsed, ~{duration(left)} left"
        print(f"{self.what}: {counted}, {times}", flush=True)
