"""Helpers of the property tests in this folder: a time and memory bound on one case, the process's resident memory,
and one torch thread while a test runs (the CI machine has 2 cores, shared).

bounded() puts three limits on the code inside it (Linux; elsewhere only the time limits):
- a SIGALRM after `seconds` that raises CaseTimeout where Python code runs (a hang in Python fails the case);
- faulthandler's watchdog thread, which dumps every thread's stack and ends the process after 3 * seconds + 5
  (a hang inside C code, where no Python signal handler runs, ends the run instead of hanging CI);
- an address-space limit of what the process maps now plus `memory` bytes, so a huge allocation fails at once
  (MemoryError, or torch's RuntimeError) instead of taking the machine.
"""

import contextlib
import faulthandler
import os
import re
import signal
import sys
import threading

import pytest
import torch

LINUX = sys.platform.startswith("linux")


class CaseTimeout(Exception):
    """A bounded case ran past its time limit."""


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmSize:\s+(\d+)", f.read())[1]) << 10


@contextlib.contextmanager
def bounded(seconds: float = 10.0, memory: int = 1 << 30, what: str = "the case"):
    main = threading.current_thread() is threading.main_thread()

    def alarm(signum, frame):
        raise CaseTimeout(f"{what} ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm) if main else None
    if main:
        signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(3 * seconds + 5, exit=True)
    limits = None
    if LINUX:
        import resource
        limits = resource.getrlimit(resource.RLIMIT_AS)
        soft, hard = limits
        want = _vm_size() + memory
        resource.setrlimit(resource.RLIMIT_AS, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    try:
        yield
    finally:
        if limits is not None:
            import resource
            resource.setrlimit(resource.RLIMIT_AS, limits)
        faulthandler.cancel_dump_traceback_later()
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def rss_bytes() -> int:
    """Resident memory of this process now (Linux: /proc/self/statm), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture
def one_thread():
    """torch on one intra-op thread for the test (2 shared cores: more threads only spin), restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
