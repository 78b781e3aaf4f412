"""The run as a process: one folder to write into, held by one run at a time (its lock), Ctrl-C
and SIGTERM ending it as one line that says how to resume, and every failure a user can cause as
one line, never a traceback."""

import contextlib
import errno
import fcntl
import functools
import os
import signal
import stat
import sys
from pathlib import Path

from ..checkpoint import CheckpointError
from . import data, devices
from .store import RunError


def check_writable(out: Path, flag: str, fail) -> None:
    """fail(message) unless `out` is a folder, or can be made one, that this user may write."""
    if out.exists() and not out.is_dir():
        fail(f"{flag} {out} exists and is not a directory")
    parent = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        fail(f"{flag} {out} cannot be created: {parent} is not a writable folder")


STOPS = []  # the signals that have stopped the run under the guard, in order of arrival


def _ignore_signals():
    """From here on SIGINT and SIGTERM are ignored: the run is ending already, and one raised
    while it unwinds or exits (torchrun's SIGTERM to the ranks left after one fails) would break
    that off with a traceback or an "Exception ignored" one. One pending as they are set (its
    handler runs first, and ignores them too) is dropped: the run is ending on a stop already."""
    with contextlib.suppress(KeyboardInterrupt):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _stop(number, frame):
    """SIGINT and SIGTERM end the run alike, unwinding (temporaries removed, the lock released);
    later ones are ignored, unless Python drops this one (_heard_again): a second Ctrl-C ms later
    would break the unwinding off with a traceback."""
    _ignore_signals()
    STOPS.append(number)
    raise KeyboardInterrupt(signal.Signals(number).name)


def _heard_again(kept: list, hook, unraisable):
    """sys.unraisablehook under the guard. A stop that Python dropped, raised in a finalizer (its
    handler had ignored every later signal: the run went on, deaf, to exit 0), leaves the `kept`
    signals stopping the run again, and the guard's end fails for it; other reports go to `hook`."""
    if not (STOPS and isinstance(unraisable.exc_value, KeyboardInterrupt)):
        return hook(unraisable)
    for sig in kept:  # not re-delivered now: its handler would run in this hook, dropped again
        signal.signal(sig, _stop)


@contextlib.contextmanager
def one_line_errors(fail):
    """Every failure a user can cause as one line through fail(message), never a traceback: a bad
    checkpoint, data file or setting, a full disk or a read-only folder (atomic_write names the
    file), and Ctrl-C or SIGTERM (finished stages and saved progress stay; the same command
    resumes)."""
    # not a signal ignored from the start (`nohup`, a shell's `&`): the user asked to keep running
    kept = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) != signal.SIG_IGN]
    STOPS.clear()
    hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_heard_again, kept, hook)
    before = {sig: signal.signal(sig, _stop) for sig in kept}
    try:
        yield
        if STOPS:  # every stop's KeyboardInterrupt dropped (_heard_again): still a stop
            raise _first_stop()
    except BaseException as err:
        if kept:  # not when the user asked to keep running: those stay ignored anyway
            _ignore_signals()
        sys.unraisablehook = hook
        # after a stop, what the unwinding raised (an OSError of a file closed under it) is its
        # consequence: the line is the stop's
        fail(_one_line(_first_stop() if STOPS and not isinstance(err, SystemExit) else err))
    sys.unraisablehook = hook
    for sig, handler in before.items():  # not after a failure: its exit ignores them
        signal.signal(sig, handler)


def _first_stop() -> KeyboardInterrupt:
    """The first signal that stopped the run, as the KeyboardInterrupt _stop raised for it."""
    return KeyboardInterrupt(signal.Signals(STOPS[0]).name)


def _one_line(err: BaseException) -> str:
    """A failure's one line, or `err` raised again: a program's own exit, or a bug's traceback."""
    if isinstance(err, (CheckpointError, data.DataError, RunError, devices.RankError)):
        return str(err)
    if isinstance(err, KeyboardInterrupt):
        stopped = "terminated" if err.args == ("SIGTERM",) else "interrupted"
        return f"{stopped}; run the same command again to resume"
    if isinstance(err, RuntimeError) and devices.world() > 1:  # mostly a collective whose peer
        return f"{str(err).splitlines()[0]}; run the same command again to resume"  # stopped
    if isinstance(err, OSError):  # atomic_write's own message names the file already
        named = err.filename and str(err.filename) not in (err.strerror or "")
        return f"{err.filename}: {err.strerror}" if named else err.strerror or str(err)
    raise err


@contextlib.contextmanager
def locked(out: Path, fail):
    """Hold `out` for one run: a second run into the same folder stops at once, naming the first
    one's PID (two runs would overwrite each other's results). A folder the run left empty is
    removed, so a failed run or a plan leaves none behind."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = out / ".lock"
    with _open_lock(lock, fail) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy = f"--out {out} is in use by another run (PID {f.read().strip() or '?'})"
            fail(f"{busy}; wait for it to finish or choose another --out")
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            if [p.name for p in out.iterdir()] == [lock.name]:
                lock.unlink()
                if created:
                    out.rmdir()


def _open_lock(lock: Path, fail):
    """`lock` opened to read and write, created if absent, never through a link (a `.lock` link
    planted in a shared --out would have its target overwritten) and only if a regular file (a
    FIFO would block): else fail(message)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        number = os.open(lock, flags, 0o644)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        fail(f"{lock} is a symbolic link; expected the run's own lock file (remove the link)")
    if not stat.S_ISREG(os.fstat(number).st_mode):
        os.close(number)
        fail(f"{lock} is not a regular file; expected the run's own lock file (remove it)")
    return os.fdopen(number, "r+")
