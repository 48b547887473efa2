"""Hostile programs the sandbox must stop, each with the statuses that count as stopped.

Shared by tests/rewards/test_sandbox.py (which also checks that each run leaves no
process, file or memory behind) and scripts/bench_sandbox.py (which times them).
"""

from __future__ import annotations

import dataclasses
import os

from jaxrl_post.rewards.sandbox import Limits

# Small, so the whole set runs in seconds on a loaded 2-core machine. Not 1 s: in a VM,
# first-touch page faults can make filling 256 MB take over a second by themselves.
LIMITS = Limits(timeout_s=2.0, memory_mb=256)

# Files a run must not be able to create: one in /tmp (world-writable) and one in the
# repository (root-owned, which a root caller could write without the sandbox's uid).
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ESCAPE_PATHS = ("/tmp/jaxrl_sandbox_escape", os.path.join(_REPO, ".sandbox_escape"))


@dataclasses.dataclass(frozen=True)
class Case:
  """A hostile program.

  Attributes:
    source: The program.
    statuses: The outcomes that count as stopped (a program cannot always be stopped
      the same way: a fork bomb dies of the process limit, or of the hook where there
      is no such limit).
    tests: Test code run after it, if any.
    needs: An isolation layer the expected outcome depends on (skip without it).
  """

  source: str
  statuses: frozenset[str]
  tests: str | None = None
  needs: str | None = None


def _case(source: str, *statuses: str, **kwargs) -> Case:
  return Case(source, frozenset(statuses), **kwargs)


_LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"

HOSTILE: dict[str, Case] = {
    "infinite_loop": _case("while True:\n  pass\n", "timeout"),
    "sleep_past_limit": _case("import time\ntime.sleep(60)\n", "timeout"),
    # Dies of RLIMIT_NPROC (BlockingIOError) or, without a process limit, of the hook.
    "fork_bomb": _case("import os\nwhile True:\n  os.fork()\n", "failed", "blocked"),
    # Keeps max_procs processes spinning until the wall-time limit.
    "fork_bomb_retrying": _case(
        "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n",
        "timeout", "blocked"),
    # Thread creation fails at the process (and thread) limit or for stack space:
    # RuntimeError, so "failed"; the daemon threads do not hold up the exit.
    "thread_bomb": _case(
        "import threading, time\nfor _ in range(10000):\n"
        "  threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n",
        "failed"),
    "memory_bomb": _case("chunks = []\nwhile True:\n  chunks.append(b'x' * 2**24)\n",
                         "memory"),
    "segfault": _case("import ctypes\nctypes.string_at(0)\n", "crashed"),
    "huge_output": _case("while True:\n  print('x' * 4096)\n", "output_limit"),
    "write_tmp": _case(f"open({ESCAPE_PATHS[0]!r}, 'w').write('escaped')\n", "blocked"),
    "write_repo": _case(f"open({ESCAPE_PATHS[1]!r}, 'w').write('escaped')\n", "blocked"),
    # ctypes bypasses the audit hook; the read-only mounts still refuse the write.
    "write_tmp_ctypes": _case(
        _LIBC + f"fd = libc.open({ESCAPE_PATHS[0].encode()!r}, os.O_WRONLY | os.O_CREAT, "
        "0o644)\nif fd < 0:\n  raise OSError(ctypes.get_errno(), 'open failed')\n",
        "failed", needs="readonly"),
    "network": _case("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n",
                     "blocked"),
    # ctypes again: the socket opens, but a network namespace has no route out.
    "network_ctypes": _case(
        _LIBC + "import socket, struct\nfd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)\n"
        "addr = struct.pack('<HH4s8x', socket.AF_INET, socket.htons(80), bytes([1, 1, 1, 1]))\n"
        "if libc.connect(fd, addr, len(addr)) != 0:\n"
        "  raise OSError(ctypes.get_errno(), 'connect failed')\n",
        "failed", needs="netns"),
    "subprocess": _case("import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])\n",
                        "blocked"),
    # A daemon that leaves the process group and outlives the program: the run is fine
    # (or its fork refused, where nothing bounds processes), and the test checks that
    # the daemon is gone anyway.
    "orphan_daemon": _case("import os, time\nif os.fork() == 0:\n  os.setsid()\n"
                           "  while True:\n    time.sleep(0.01)\n", "ok", "blocked"),
    # Reward hacks: skipping the tests must not pass them.
    "exit_before_tests": _case("import sys\nsys.exit(0)\n", "failed", tests="assert False\n"),
    "os_exit_before_tests": _case("import os\nos._exit(0)\n", "failed",
                                  tests="assert False\n"),
}
