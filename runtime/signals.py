"""SIGTERM ended as Ctrl-C ends a command (runtime.cli.run_cli): a scheduler's preemption, `timeout` or torchrun stopping
its workers gets what is complete kept and the way on printed, with the exit code a shell gives a SIGTERM; a command
blocked inside a library call is still ended (a watchdog on the signal module's wakeup fd)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # as a shell reports a process Ctrl-C or SIGTERM ends


class Terminated(KeyboardInterrupt):
    """SIGTERM: a scheduler's preemption, `timeout`, `kill`, torchrun stopping its workers. It ends a command as
    Ctrl-C does (what is complete is kept, the way on is printed), with the exit code a shell gives a SIGTERM."""

    exit_code = EXIT_TERMINATED


# How long a command may take to end after SIGTERM before it is ended without its clean-up: Python runs the handler
# only between its own steps, and native code blocked in a call that retries on EINTR (a FIFO's open in a Parquet
# reader) never returns to it. Before SIGTERM ended a command as Ctrl-C does, its default action killed the process.
TERM_GRACE_S = 30.0


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM raised as Terminated in the main thread while a command's body runs, where nothing else (a launcher,
    a notebook, a test) handles it already; the handler there before is put back after. A watchdog thread learns of
    each SIGTERM at once (the signal module's wakeup fd, written by the C-level handler whatever the main thread is
    doing): a command still running TERM_GRACE_S after one, or given a second, is ended as SIGTERM's default would."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        before = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread's interpreter
        before = None
    if before not in (None, -1):  # another wakeup fd (an event loop's): keep it, without the watchdog
        signal.set_wakeup_fd(before)
    done = threading.Event()
    if before == -1:
        threading.Thread(target=_watch_terminate, args=(read_fd, done), daemon=True, name="sigterm-watch").start()

    def terminated(_signum, _frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        done.set()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if before == -1:
            signal.set_wakeup_fd(-1)
        os.close(write_fd)  # the watchdog's read ends; it closes read_fd
        if before != -1:
            os.close(read_fd)


def _watch_terminate(read_fd: int, done: threading.Event) -> None:
    """The wakeup fd's reader (terminate_as_interrupt): at a second SIGTERM, or TERM_GRACE_S after the
    first if the command has not ended, the process ends with SIGTERM's exit code, saying why. The command's end
    closes the pipe's other end, which ends this thread."""
    import select
    import time

    seen, deadline = 0, None
    try:
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([read_fd], [], [], wait)
            if done.is_set():
                return
            if not ready:  # the grace ran out
                break
            data = os.read(read_fd, 64)
            if not data:
                return
            seen += data.count(bytes([signal.SIGTERM]))
            if seen > 1:
                break
            if seen == 1 and deadline is None:
                deadline = time.monotonic() + TERM_GRACE_S
        os.write(2, (f"terminated (SIGTERM): the command did not stop within {TERM_GRACE_S:g} s (blocked inside a "
                     "library call), so it ends without its clean-up; completed work is kept: re-run the same command "
                     "to resume\n" if seen == 1 else "terminated (SIGTERM, twice): ending now, without the clean-up\n"
                     ).encode())
        os._exit(EXIT_TERMINATED)
    finally:
        try:
            os.close(read_fd)
        except OSError:
            pass
