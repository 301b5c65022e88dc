"""The services a launcher supervises: each child process, its restarts (backoff,
crash-loop limit), and the signal mask that keeps a start-up step whole."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from services.launcher.servers import own_session_dying_with_parent

_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}

DEFAULT_MAX_RESTARTS = 5  # per child within RESTART_WINDOW_S; one more death stops all
RESTART_WINDOW_S = 60.0
RESTART_BACKOFF_S = (0.5, 30.0)  # the first restart's delay, doubling up to the second


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends: a server started in it (its own
    session, so the terminal's Ctrl-C does not reach it) is in `Launcher.servers`,
    which stop() reaches, before the KeyboardInterrupt can be raised. The server itself
    starts with the mask cleared (`own_session_dying_with_parent`)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


@dataclass
class Restarts:
    """The deaths of one supervised process within RESTART_WINDOW_S and its next start."""

    deaths: deque[float] = field(default_factory=deque)  # monotonic times
    restart_at: float | None = None  # monotonic time of a scheduled start (inf: never)

    def schedule(self, now: float, max_restarts: int) -> float | None:
        """Count a death at `now`: the delay before the restart, or None when this is
        one death too many within the window (a crash loop)."""
        while self.deaths and now - self.deaths[0] > RESTART_WINDOW_S:
            self.deaths.popleft()
        self.deaths.append(now)
        if len(self.deaths) > max_restarts:
            return None
        first, cap = RESTART_BACKOFF_S
        delay = min(cap, first * 2 ** (len(self.deaths) - 1))
        self.restart_at = now + delay
        return delay

    def is_due(self, now: float) -> bool:
        if self.restart_at is None or self.restart_at > now:
            return False
        self.restart_at = None
        return True


@dataclass
class Child:
    name: str
    cmd: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    restarts: Restarts = field(default_factory=Restarts)

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

    @property
    def is_worker(self) -> bool:
        return self.name.startswith("worker ")

    def start(self, env: dict[str, str]) -> None:
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=own_session_dying_with_parent,
            )
