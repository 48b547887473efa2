"""Running untrusted (model-written) Python programs with limits, and classifying the end.

`run_program(source, tests, limits=...)` runs `source` and then `tests` in one namespace,
as `__main__`, in a fresh interpreter (`python -I -S`: no site-packages, no environment
variables, no user site) that starts in a new session with a minimal environment. The
child side, `sandbox_boot.py`, stacks these layers, each where the OS allows it (the
result's `isolation` names those that took):

  * namespaces: network (no interfaces but a down loopback), PID (the program's init
    dies with it, and the kernel then kills every process left), mount, IPC, UTS;
  * a private filesystem view: everything read-only, the work directory and /dev/shm
    fresh tmpfs mounts of `disk_mb`, /proc showing only the run's processes, and /tmp,
    /var/tmp and any directory only root may enter (pyenv under /root) covered, but for
    the stdlib and the work directory;
  * a uid of its own (as root): RLIMIT_NPROC is then enforced (root is exempt) and
    counts this run's processes and threads alone, and stragglers can be found by uid;
  * rlimits: address space, CPU seconds, file size, open files, no core files;
  * an audit hook (which Python code cannot remove) that ends the program on a write
    outside its directory, a non-Unix socket or a name lookup, or a new program (exec,
    spawn, subprocess), so those runs are reported as "blocked"; for a program left
    running as root (no uid of its own could be used) also on fork, on signals to other
    processes and on rlimit changes, which nothing else would bound.

The parent enforces the wall-clock limit and the output cap while reading the pipes, and
on either stops the run: SIGTERM to the supervisor, which kills the init (and with it the
PID namespace), then SIGKILL to the whole process group, then, as root without a PID
namespace, any process left with the run's uid. The temporary directory is removed in
every case.

Known limits: the audit hook and the "done" record live in the program's process, so a
program that uses ctypes or inspects the interpreter (frames, gc) can get past the hook
or forge a pass; with namespaces and a uid of its own, that buys it nothing more than
lying about its tests. An unprivileged caller gets no namespaces and no uid: the rlimits
(RLIMIT_NPROC counting from the caller's own processes), the hook, and the supervisor
and init as child subreapers that kill what the program leaves behind. As root without
namespaces, if no other uid can read the stdlib, the program runs as root behind the
hook alone. The program gets no stdin and only the stdlib (-S); Linux only. A caller
killed by SIGKILL takes its runs with it (parent-death signals) but leaves their empty
temporary directories.

A leaf module: stdlib only, no jax; safe to call from the verifier worker threads (the
child is started by fork-exec in C, with no Python code between).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

STATUSES = ("ok", "failed", "timeout", "memory", "crashed", "output_limit", "blocked")

# Sandbox uids are UID_BASE + the supervisor's pid: above any real account, and unique
# among live runs because their supervisors' pids are.
UID_BASE = 1 << 30
EXCERPT_CHARS = 2000

_BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_boot.py")
_MAX_RECORD_BYTES = 64 * 1024  # Of the control pipes; the program can write its own.
_STOP_GRACE_S = 1.0  # For the supervisor to kill its init after SIGTERM.
_DRAIN_S = 0.2  # For the pipes to close once the supervisor has exited.


class SandboxError(RuntimeError):
  """The sandbox itself failed (could not start, or its setup broke); not the program."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one run may use.

  Attributes:
    timeout_s: Wall-clock seconds from start to finish, interpreter start included.
    memory_mb: Address space of each of the program's processes (RLIMIT_AS), so thread
      stacks and mapped libraries count as well as the heap.
    cpu_s: CPU seconds (RLIMIT_CPU) of each process; None: ceil(timeout_s).
    max_procs: Processes plus threads the program may run at once, itself included.
    output_bytes: stdout and stderr together; more stops the run ("output_limit").
    disk_mb: Size of the work directory (and of each file written there).
    namespaces: Use Linux namespaces where the OS allows; False skips them (the
      rlimits, the hook and, if the stdlib allows it, the uid remain).
  """

  timeout_s: float = 5.0
  memory_mb: int = 512
  cpu_s: int | None = None
  max_procs: int = 32
  output_bytes: int = 1 << 20
  disk_mb: int = 64
  namespaces: bool = True

  def __post_init__(self):
    if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
        or not 0 < self.timeout_s < math.inf):
      raise ValueError(f"Limits.timeout_s must be a positive number, got {self.timeout_s!r}")
    for name, least in (("memory_mb", 32), ("max_procs", 1), ("output_bytes", 1),
                        ("disk_mb", 1), ("cpu_s", 1)):
      value = getattr(self, name)
      if value is None and name == "cpu_s":
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"Limits.{name} must be an int >= {least}, got {value!r}")

  @property
  def cpu_seconds(self) -> int:
    return self.cpu_s if self.cpu_s is not None else max(1, math.ceil(self.timeout_s))


@dataclasses.dataclass(frozen=True)
class Result:
  """How a run ended.

  Attributes:
    status: One of STATUSES.
    reason: One line saying why, e.g. "AssertionError: f(2) != 4".
    returncode: The program's exit code, -N for signal N, None when the sandbox
      stopped it (timeout, output limit).
    stdout: Excerpt of what it printed (head and tail, at most EXCERPT_CHARS).
    stderr: Excerpt of its stderr, likewise.
    seconds: Wall time from start until every process of the run was gone.
    isolation: The layers the OS allowed, e.g. ("netns", "pidns", "uid", ...).
  """

  status: str
  reason: str
  returncode: int | None
  stdout: str
  stderr: str
  seconds: float
  isolation: tuple[str, ...] = ()

  def as_dict(self) -> dict:
    return dataclasses.asdict(self) | {"isolation": list(self.isolation)}


def run_program(source: str, tests: str | None = None, *, limits: Limits) -> Result:
  """Runs `source`, then `tests` in the same namespace, in a sandbox.

  Args:
    source: The program, run as `__main__`.
    tests: Code run after it, e.g. HumanEval's `def check(candidate): ...` followed by
      `check(entry_point)`; a failing assert makes the run "failed". The program's
      `sys.exit()` before the tests counts as a failure, as does `os._exit()` anywhere.
    limits: What the run may use.

  Returns:
    The `Result`; its status is "ok" only if the program (and tests) ran to the end.

  Raises:
    SandboxError: The sandbox could not run the program (never because of what the
      program did).
  """
  if not isinstance(source, str) or not (tests is None or isinstance(tests, str)):
    raise TypeError(f"run_program needs str source and str or None tests, got "
                    f"{type(source).__name__} and {type(tests).__name__}")
  if not isinstance(limits, Limits):
    raise TypeError(f"run_program needs limits=Limits(...), got {type(limits).__name__}")
  root = tempfile.mkdtemp(prefix="jaxrl-sandbox-")
  try:
    return _Run(root, limits).execute(source, tests)
  finally:
    _remove_tree(root)


class _Run:
  """One sandboxed run: starts the child, collects its pipes, stops it, classifies."""

  def __init__(self, root: str, limits: Limits):
    self.root, self.limits = root, limits
    self.workdir = os.path.join(root, "work")
    self.nonce = secrets.token_hex(16)
    self.out = {"stdout": bytearray(), "stderr": bytearray(), "report": bytearray(),
                "marker": bytearray()}
    self.stopped_for: str | None = None  # "timeout" or "output_limit".

  def execute(self, source: str, tests: str | None) -> Result:
    os.chmod(self.root, 0o711)  # The program's uid may pass through, not list or read.
    os.mkdir(self.workdir, 0o700)
    fds = [*os.pipe(), *os.pipe()]
    report_r, report_w, marker_r, marker_w = fds
    try:
      payload = os.path.join(self.root, "payload.json")
      with open(os.open(payload, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump(self._payload(source, tests, report_w, marker_w), f)
      start = time.monotonic()
      try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", "-u", "-X", "utf8", _BOOT, payload],
            cwd=self.workdir, env=self._env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(report_w, marker_w),
            start_new_session=True)
      except OSError as e:
        raise SandboxError(f"could not start the sandbox: {e}") from e
      finally:
        for fd in (report_w, marker_w):  # Our copies would keep the pipes from closing.
          os.close(fd)
          fds.remove(fd)
      try:
        self._collect(proc, report_r, marker_r, start + self.limits.timeout_s)
      finally:
        self._stop(proc)
    finally:
      for fd in fds:
        os.close(fd)
    return self._classify(time.monotonic() - start, tests is not None)

  def _payload(self, source: str, tests: str | None, report_w: int, marker_w: int) -> dict:
    limits = dataclasses.asdict(self.limits) | {"cpu_s": self.limits.cpu_seconds}
    return {"source": source, "tests": tests, "nonce": self.nonce, "limits": limits,
            "workdir": self.workdir, "report_fd": report_w, "marker_fd": marker_w,
            "parent_pid": os.getpid(), "uid_base": UID_BASE}

  def _env(self) -> dict[str, str]:
    # Nothing inherited: API keys and tokens in the trainer's environment stay there.
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": self.workdir,
            "TMPDIR": self.workdir}

  def _collect(self, proc: subprocess.Popen, report_r: int, marker_r: int,
               deadline: float) -> None:
    """Reads all four pipes until they close, the deadline, or the output cap."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    sel.register(report_r, selectors.EVENT_READ, "report")
    sel.register(marker_r, selectors.EVENT_READ, "marker")
    with sel:
      while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
          self.stopped_for = self.stopped_for or "timeout"
          return
        for key, _ in sel.select(left):
          chunk = os.read(key.fd, 65536)
          if not chunk:
            sel.unregister(key.fileobj)
            if key.data == "report":  # The supervisor and init are gone.
              deadline = min(deadline, time.monotonic() + _DRAIN_S)
            continue
          buf = self.out[key.data]
          if key.data in ("stdout", "stderr"):
            buf += chunk
            if len(self.out["stdout"]) + len(self.out["stderr"]) > self.limits.output_bytes:
              self.stopped_for = "output_limit"
              return
          elif len(buf) < _MAX_RECORD_BYTES:
            buf += chunk[:_MAX_RECORD_BYTES - len(buf)]

  def _stop(self, proc: subprocess.Popen) -> None:
    """Leaves no process of the run behind, and reaps the supervisor.

    The supervisor is reaped last: until then its pid, which is also the process
    group's id, cannot be reused, so the group kill cannot reach anyone else's group.
    (Popen.poll and Popen.send_signal would reap it, hence os.waitid and os.kill.)
    """
    pid = proc.pid
    try:
      if not _exited(pid):
        os.kill(pid, signal.SIGTERM)  # The supervisor kills its init, and so the PID ns.
        give_up = time.monotonic() + _STOP_GRACE_S
        while not _exited(pid) and time.monotonic() < give_up:
          time.sleep(0.005)
      os.killpg(pid, signal.SIGKILL)  # Whatever is left in the group, if anything.
    except ProcessLookupError:
      pass  # The group is empty.
    except ChildProcessError:
      pass  # A wait() elsewhere in this process reaped it: the pid is no longer ours.
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    if os.geteuid() == 0 and "pidns" not in self.isolation():
      _kill_uid(UID_BASE + pid)  # Those that left the group, found by their uid.

  def isolation(self) -> tuple[str, ...]:
    """The layers reported by the supervisor and init (which arrive in either order)."""
    return tuple(sorted({str(layer) for record in _records(self.out["report"])
                         for layer in record.get("layers", ())}))

  def _classify(self, seconds: float, tests_given: bool) -> Result:
    reports = _records(self.out["report"])
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
      raise SandboxError(_one_line(str(errors[0])))
    if not any("layers" in r for r in reports) and self.stopped_for is None:
      raise SandboxError("the sandbox exited before it started the program: "
                         + _one_line(self.out["stderr"].decode(errors="replace")[-300:]))
    end = next((r for r in reports if "exit" in r or "signal" in r), None)
    status, reason = self._verdict(end, _records(self.out["marker"]), tests_given)
    returncode = None if end is None else end.get("exit", -end.get("signal", 0))
    return Result(status=status, reason=_one_line(reason), returncode=returncode,
                  stdout=_excerpt(self.out["stdout"]), stderr=_excerpt(self.out["stderr"]),
                  seconds=round(seconds, 3), isolation=self.isolation())

  def _verdict(self, end: dict | None, markers: list[dict],
               tests_given: bool) -> tuple[str, str]:
    """(status, reason) from how the run was stopped, init's report, and the records."""
    limits = self.limits
    blocked = next((m["blocked"] for m in markers if "blocked" in m), None)
    exc = next((m for m in markers if "exc" in m), None)
    if self.stopped_for == "output_limit":
      return "output_limit", f"stdout and stderr over {limits.output_bytes} bytes"
    if blocked is not None:
      return "blocked", str(blocked)
    if self.stopped_for == "timeout":
      return "timeout", f"still running after the {limits.timeout_s:g} s wall-time limit"
    if end is None:
      return "crashed", "the sandbox's init ended without a report"
    if "signal" in end:
      return self._signal_verdict(end)
    if exc is not None and exc["exc"] == "MemoryError":
      return "memory", f"MemoryError under the {limits.memory_mb} MB limit"
    if end["exit"] == 0:
      if any(m.get("done") == self.nonce for m in markers):
        return "ok", "ran to the end" + (" and passed the tests" if tests_given else "")
      return "failed", "exit code 0 before the end (os._exit?)"
    if exc is not None:
      return "failed", f"{exc['exc']}: {exc.get('msg', '')}".rstrip(": ")
    return "failed", f"exit code {end['exit']}"

  def _signal_verdict(self, end: dict) -> tuple[str, str]:
    sig = end["signal"]
    try:
      name = signal.Signals(sig).name
    except ValueError:
      name = f"signal {sig}"
    cpu = self.limits.cpu_seconds
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and end.get("cpu_s", 0) >= cpu):
      return "timeout", f"over the {cpu} s CPU-time limit ({name})"
    if sig == signal.SIGKILL and end.get("maxrss_mb", 0) >= 0.9 * self.limits.memory_mb:
      return "memory", f"killed by SIGKILL near the {self.limits.memory_mb} MB limit"
    return "crashed", f"killed by {name}"


def _remove_tree(root: str) -> None:
  """Removes `root`, also where the program took its own permissions away (a run
  without a mount namespace writes to the real directory)."""
  for dirpath, dirnames, _ in os.walk(root):
    for name in dirnames:
      path = os.path.join(dirpath, name)
      if not os.path.islink(path):
        try:
          os.chmod(path, 0o700)  # Before os.walk goes in, since it walks top-down.
        except OSError:
          pass
  shutil.rmtree(root, ignore_errors=True)


def _exited(pid: int) -> bool:
  """Whether our child `pid` has exited, leaving it unreaped."""
  return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_uid(uid: int) -> None:
  """SIGKILLs every process whose real uid is `uid`, until none is left."""
  for _ in range(200):
    pids = [pid for pid in _pids() if _uid_of(pid) == uid]
    if not pids:
      return
    for pid in pids:
      try:
        fd = os.pidfd_open(pid)
      except OSError:
        continue  # Gone already.
      try:
        if _uid_of(pid) == uid:  # Still the same process: the pidfd pins it.
          signal.pidfd_send_signal(fd, signal.SIGKILL)
      except OSError:
        pass
      finally:
        os.close(fd)
    time.sleep(0.005)


def _pids() -> list[int]:
  return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _uid_of(pid: int) -> int | None:
  """The real uid of `pid`, None if it is gone."""
  try:
    with open(f"/proc/{pid}/status", "rb") as f:
      for line in f:
        if line.startswith(b"Uid:"):
          return int(line.split()[1])
  except (OSError, ValueError, IndexError):
    pass
  return None


def _records(buf: bytes) -> list[dict]:
  """The JSON objects on the lines of a control pipe; anything else is skipped."""
  records = []
  for line in bytes(buf).splitlines():
    try:
      record = json.loads(line)
    except ValueError:
      continue
    if isinstance(record, dict):
      records.append(record)
  return records


def _excerpt(data: bytes, limit: int = EXCERPT_CHARS) -> str:
  """Head and tail of `data` as text, at most `limit` characters plus a cut marker."""
  text = bytes(data).decode("utf-8", errors="replace")
  if len(text) <= limit:
    return text
  half = limit // 2
  return f"{text[:half]}\n...[{len(text) - 2 * half} chars cut]...\n{text[-half:]}"


def _one_line(text: str, limit: int = 300) -> str:
  text = " ".join(text.split())
  return text if len(text) <= limit else text[:limit - 3] + "..."
