"""The next steps' batches, assembled on one background thread while the current step trains.

``Ahead(assemble, depth, end)`` calls ``assemble(step)`` for step after step below ``end`` on its
thread and keeps at most ``depth`` finished steps in a bounded queue; ``get(step)`` hands them
over in order (a step from ``end`` on is assembled by ``get`` itself, on the caller's thread). What a
step holds is still a pure function of the step: asked for any other step than the next one (a
resume, a test), it drops what it assembled and starts again there. An error raised while
assembling a step is raised by ``get`` of that very step, as a read on the training thread would
have raised it, and the thread stops there. ``close`` stops the thread and waits for it, whatever
it was doing: waiting for room in the queue, or in the middle of a step (it finishes that one).

``pending(step)`` says, without waiting, whether the next step is still being assembled and what
assembling it raised; ``wait(step, timeout)`` waits for it at most that long (the stop agreement of
a launch asks both, so that no rank waits for a read inside a collective and every rank knows of
another's failed read before the step).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Generic, Optional, TypeVar, cast

T = TypeVar("T")
THREAD_NAME = "batch-assembly"
JOIN_S = 60.0  # how long close waits for a step being assembled (a download in flight)


class Ahead(Generic[T]):
    def __init__(self, assemble: Callable[[int], T], depth: int = 2, end: Optional[int] = None) -> None:
        self._assemble, self.depth, self.end = assemble, max(1, int(depth)), end
        self._cond = threading.Condition()
        self._ready: deque[tuple[int, Optional[T], Optional[BaseException]]] = deque()
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._next: Optional[int] = None  # the step the next ``get`` should ask for
        self.wait_s = 0.0  # seconds ``get`` waited for a step to be ready
        self.closed = False

    def get(self, step: int) -> T:
        if self.closed:
            raise RuntimeError("batches asked of a closed background assembly")
        if self.end is not None and step >= self.end:  # past what the stage trains: nothing ahead
            started = time.perf_counter()
            try:
                return self._assemble(step)
            finally:
                self.wait_s += time.perf_counter() - started
        if self._thread is None or step != self._next:
            self._restart(step)
        started = time.perf_counter()
        with self._cond:
            while not self._ready and not self._stop:
                self._cond.wait()
            if not self._ready:  # closed meanwhile (from another thread)
                raise RuntimeError("the background assembly was closed while a step waited for it")
            got, item, error = self._ready.popleft()
            self._cond.notify_all()
        self.wait_s += time.perf_counter() - started
        assert got == step, f"assembled step {got}, asked for {step}"
        self._next = step + 1
        if error is not None:
            raise error
        return cast(T, item)  # assembled: an item, not an error

    def _ahead_of(self, step: int) -> bool:
        """Whether ``get(step)`` would take what the thread assembles (else it assembles itself)."""
        return self._thread is not None and step == self._next and (self.end is None or step < self.end)

    def pending(self, step: int) -> tuple[bool, Optional[BaseException]]:
        """Before ``get(step)``, without waiting: (the thread still assembles it, the error assembling
        it raised). Nothing pending for a step ``get`` would assemble itself."""
        with self._cond:
            if self.closed or self._stop or not self._ahead_of(step):
                return False, None
            if not self._ready:
                return True, None
            got, _, error = self._ready[0]
            return False, error if got == step else None

    def wait(self, step: int, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for ``step`` to be assembled (or to have failed)."""
        with self._cond:
            if self._ahead_of(step):
                self._cond.wait_for(lambda: bool(self._ready) or self._stop, timeout)

    def start(self, step: int) -> None:
        """Assemble from ``step`` on now, before it is asked for (a stage's first step, while the
        model and engine are built: its shards are fetched meanwhile); ``get(step)`` then takes
        what is ready. Nothing is assembled ahead from ``end`` on."""
        if self.closed:
            raise RuntimeError("start of a closed background assembly")
        if (self.end is None or step < self.end) and (self._thread is None or step != self._next):
            self._restart(step)

    def _restart(self, step: int) -> None:
        self._join()
        self._stop, self._next = False, step
        self._thread = threading.Thread(target=self._run, args=(step,), name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _run(self, step: int) -> None:
        while self.end is None or step < self.end:
            try:
                item, error = self._assemble(step), None
            except BaseException as exc:  # handed to the step that needed it, raised there
                item, error = None, exc
            with self._cond:
                while len(self._ready) >= self.depth and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                self._ready.append((step, item, error))
                self._cond.notify_all()
            if error is not None:
                return
            step += 1

    def request_stop(self) -> None:
        """Tell the thread to stop after the step it is assembling (never blocks)."""
        with self._cond:
            self._stop = True
            self._ready.clear()
            self._cond.notify_all()

    def _join(self) -> None:
        self.request_stop()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(JOIN_S)
        with self._cond:
            self._ready.clear()

    def close(self) -> None:
        """Stop the thread and wait for it; no thread is left behind."""
        self._join()
        self.closed = True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
