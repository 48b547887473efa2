"""The child side of `jaxrl_post.rewards.sandbox`: run as a script, never imported.

`run_program` starts `python -I -S -B -u -X utf8 sandbox_boot.py <payload>` in a new
session. That process and two it forks share the work:

  supervisor  reads and deletes the payload, unshares namespaces, forks the init, and
              kills the init when the parent sends SIGTERM (its way to stop a run), so
              no process of the run is ever left for the host's init to reap; without
              a PID namespace it then kills what the init left (a child subreaper).
  init        PID 1 of the new PID namespace: mounts a private, read-only view of the
              filesystem, forks the program, reaps every process, and reports how the
              program ended. Its exit makes the kernel kill whatever the program left.
  program     sets rlimits, drops to a uid of its own, installs the audit hook, and runs
              the source (then the tests) with exec.

The supervisor and init stay root and report on a pipe the program cannot write to (it
closes its copy before any untrusted code runs); the program's own records (blocked,
exception, done) go to a second pipe. Everything a process needs is imported before it
drops root: the stdlib may sit under a directory its uid cannot read without a mount
namespace.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import json
import linecache
import os
import re
import resource
import signal
import socket
import stat
import sys
import traceback
import types

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND = 32, 1024, 2048, 4096
_MS_REC, _MS_PRIVATE, _MS_RELATIME = 1 << 14, 1 << 18, 1 << 21
# Per-mount options kept when a mount is made read-only (a bind remount resets them).
_MOUNT_OPTIONS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC,
                  "noatime": _MS_NOATIME, "nodiratime": _MS_NODIRATIME,
                  "relatime": _MS_RELATIME}

# Shared scratch directories, covered in the program's view (see _unhide).
_HIDDEN = frozenset({"/tmp", "/var/tmp"})

_EXIT_SETUP = 70  # The supervisor or init failed before the program ran.
_EXIT_BLOCKED = 71  # The audit hook stopped the program.

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                        ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]


def _send(fd: int, record: dict) -> None:
  """Writes one JSON line; a line under PIPE_BUF bytes arrives whole or not at all."""
  try:
    os.write(fd, (json.dumps(record) + "\n").encode())
  except OSError:
    pass  # The reader is gone or the fd was closed: nobody is left to tell.


def _prctl(option: int, value: int) -> None:
  if _libc.prctl(option, value, 0, 0, 0) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
  enc = lambda s: None if s is None else s.encode()
  if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount {target}: {os.strerror(err)}")


# ----------------------------------------------------------------------------------------
# Supervisor


def main(argv: list[str]) -> None:
  with open(argv[1]) as f:
    payload = json.load(f)
  os.unlink(argv[1])  # The nonce inside must not stay where the program could read it.
  report = payload["report_fd"]
  try:
    # Dies with the thread that started the run, so a crashed trainer leaves no sandbox.
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # Whatever outlives a killed init comes here (a PID namespace would kill it instead).
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != payload["parent_pid"]:
      os._exit(_EXIT_SETUP)
    layers = _unshare() if payload["limits"]["namespaces"] else []
    # A uid of its own for this run: no live process has the same supervisor pid.
    payload["uid"] = payload["uid_base"] + os.getpid()
  except Exception as e:  # pylint: disable=broad-except
    _send(report, {"error": f"supervisor: {type(e).__name__}: {e}"})
    os._exit(_EXIT_SETUP)
  init_pid = None
  stop_requested = False

  def on_sigterm(signum, frame):
    nonlocal stop_requested
    stop_requested = True
    if init_pid:
      os.kill(init_pid, signal.SIGKILL)

  signal.signal(signal.SIGTERM, on_sigterm)
  init_pid = os.fork()
  if init_pid == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _exit_with(_init_main, payload, layers)
  if stop_requested:
    os.kill(init_pid, signal.SIGKILL)
  os.close(payload["marker_fd"])
  _send(report, {"layers": layers})
  os.waitpid(init_pid, 0)
  if "pidns" not in layers:
    _kill_children()
  os._exit(0)


def _unshare() -> list[str]:
  """Unshares what the OS allows, one namespace at a time; returns the names that took."""
  layers = []
  if not hasattr(os, "unshare"):  # Python < 3.12.
    return layers
  for name, flag in (("netns", os.CLONE_NEWNET), ("pidns", os.CLONE_NEWPID),
                     ("mntns", os.CLONE_NEWNS), ("ipcns", os.CLONE_NEWIPC),
                     ("utsns", os.CLONE_NEWUTS)):
    try:
      os.unshare(flag)
      layers.append(name)
    except OSError:
      pass  # Not root, or a seccomp policy: the audit hook and rlimits still apply.
  return layers


# ----------------------------------------------------------------------------------------
# Init


def _init_main(payload: dict, layers: list[str]) -> int:
  report = payload["report_fd"]
  try:
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # Orphans come here even without a PID namespace.
    uid = payload["uid"] if os.geteuid() == 0 and _mapped(payload["uid"]) else None
    layers = list(layers)
    if "mntns" in layers:
      layers += _private_view(payload, uid)
    if uid is not None and not all(map(_traversable, _stdlib_dirs() +
                                        [os.path.dirname(payload["workdir"])])):
      uid = None  # It could not import the stdlib, or reach its directory.
    if uid is not None and "tmpfs" not in layers:
      os.chown(payload["workdir"], uid, uid)
    if uid is not None:
      layers.append("uid")
    if uid is not None or os.geteuid() != 0:
      layers.append("nproc")  # Counting the uid's own processes, or the caller's.
    _send(report, {"layers": layers})
  except Exception as e:  # pylint: disable=broad-except
    _send(report, {"error": f"init: {type(e).__name__}: {e}"})
    return _EXIT_SETUP
  program_pid = os.fork()
  if program_pid == 0:
    _exit_with(_program_main, payload, uid)
  os.close(payload["marker_fd"])
  while True:
    pid, status, usage = os.wait4(-1, 0)
    if pid == program_pid:
      break
  if "pidns" not in layers:
    _kill_children()
  end = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
         else {"exit": os.waitstatus_to_exitcode(status)})
  _send(report, {**end, "cpu_s": usage.ru_utime + usage.ru_stime,
                 "maxrss_mb": usage.ru_maxrss / 1024})
  return 0


def _exit_with(fn, *args) -> None:
  """Runs `fn` in a forked child and exits with its code: never returns, so the child
  does not unwind into the frames it inherited from its parent. (No typing.NoReturn:
  importing typing would slow every run's start.)"""
  code = _EXIT_SETUP
  try:
    code = fn(*args)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    os._exit(code)


def _mapped(uid: int) -> bool:
  """Whether `uid` exists in this user namespace (a container may map only a few).

  A uid no other process has makes RLIMIT_NPROC count this run's processes and threads
  alone (root is exempt from that limit), lets the parent find stragglers by uid, and
  keeps the program out of files only root may write.
  """
  with open("/proc/self/uid_map") as f:
    for line in f:
      inside, _, count = map(int, line.split())
      if inside <= uid < inside + count:
        return True
  return False


def _stdlib_dirs() -> list[str]:
  """The import path, outermost directories only."""
  dirs = sorted({os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)})
  return [d for i, d in enumerate(dirs)
          if not any(d.startswith(o + os.sep) for o in dirs[:i])]


def _traversable(path: str) -> bool:
  """Whether a uid with no rights of its own can enter `path`."""
  parts = path.split(os.sep)
  return all(os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & stat.S_IXOTH
             for i in range(1, len(parts) + 1))


def _private_view(payload: dict, uid: int | None) -> list[str]:
  """Makes this mount namespace's filesystem read-only but for the work directory.

  Returns the layers that took; a step the OS refuses is skipped. Mounts made here stay
  in this namespace: the first call stops propagation to the host, and if it fails
  nothing else is tried.
  """
  try:
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
  except OSError:
    return []
  layers = []
  if _tried(_mount, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC):
    layers.append("procfs")
  # The caller checks whether the uid can now import, and reach the work directory.
  _tried(_unhide, _stdlib_dirs() + [payload["workdir"]])
  remounted = [_tried(_mount, None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY |
                      sum(_MOUNT_OPTIONS.get(o, 0) for o in options.split(",")))
               for target, options in _mounts()
               if target != "/proc" and not target.startswith("/proc/")]
  layers.append("readonly" if all(remounted) else "readonly-partial")
  # The only writable places, each a fresh tmpfs that dies with the namespace. Inodes
  # cost memory beyond the size limit, so they are capped too.
  size = f"size={payload['limits']['disk_mb']}m,nr_inodes=16384"
  owner = "" if uid is None else f",uid={uid},gid={uid}"
  if _tried(_mount, "tmpfs", payload["workdir"], "tmpfs", _MS_NOSUID | _MS_NODEV,
            f"{size},mode=0700{owner}"):
    layers.append("tmpfs")
  if os.path.isdir("/dev/shm"):  # multiprocessing's semaphores live there.
    _tried(_mount, "tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, f"{size},mode=1777")
  return layers


def _tried(fn, *args) -> bool:
  """Calls `fn`; whether it worked (an OSError means the OS refused)."""
  try:
    fn(*args)
    return True
  except OSError:
    return False


def _mounts() -> list[tuple[str, str]]:
  """(mount point, per-mount options) of each mount this process sees."""
  unescape = lambda s: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)
  with open("/proc/self/mountinfo") as f:
    return [(unescape(fields[4]), fields[5]) for fields in map(str.split, f)]


def _unhide(dirs: list[str]) -> None:
  """Makes `dirs` reachable by any uid, hiding the rest of their closed ancestors.

  The interpreter may live under a directory only root can enter (pyenv under /root),
  and so may the caller's TMPDIR. Such an ancestor, like the shared /tmp and /var/tmp
  (other processes' files), gets an empty tmpfs on top, and each directory under it is
  bound back at its old path: the program sees the stdlib and its own directory, and
  nothing else of, say, /root.
  """
  plan = []
  for path in dirs:
    parts = path.split(os.sep)
    closed = next((os.sep.join(parts[:i]) for i in range(2, len(parts))
                   if os.sep.join(parts[:i]) in _HIDDEN
                   or not os.stat(os.sep.join(parts[:i])).st_mode & stat.S_IXOTH), None)
    if closed is not None:  # Opened before anything is covered, to be bound back.
      plan.append((closed, path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
  try:
    for closed in dict.fromkeys(closed for closed, _, _ in plan):
      _mount("tmpfs", closed, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    for _, path, fd in plan:
      os.makedirs(path, mode=0o755, exist_ok=True)
      _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
  finally:
    for _, _, fd in plan:
      os.close(fd)


def _kill_children() -> None:
  """Kills and reaps every process left below this one (orphans are reparented here)."""
  me = os.getpid()
  for _ in range(1000):
    children = set()
    try:
      for tid in os.listdir(f"/proc/{me}/task"):
        with open(f"/proc/{me}/task/{tid}/children") as f:
          children.update(int(c) for c in f.read().split())
    except OSError:
      return  # No /proc children list in this kernel: the parent kills the group.
    if not children:
      return
    for pid in children:
      try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
      except (ProcessLookupError, ChildProcessError):
        pass


# ----------------------------------------------------------------------------------------
# Program


def _program_main(payload: dict, uid: int | None) -> int:
  """Confines this process, runs the untrusted code, and returns its exit code."""
  report, marker = payload["report_fd"], payload["marker_fd"]
  try:
    _confine(payload, uid)
  except Exception as e:  # pylint: disable=broad-except
    _send(report, {"error": f"program setup: {type(e).__name__}: {e}"})
    return _EXIT_SETUP
  os.close(report)  # Before any untrusted code: only the supervisor and init report.
  # Root without a uid of its own has no process limit, and may signal any process.
  unconfined = uid is None and os.geteuid() == 0
  sys.addaudithook(_make_hook(os.path.realpath(payload["workdir"]), marker, unconfined))
  code = _run(payload["source"], payload["tests"], payload["nonce"], marker)
  # What the interpreter does at exit, which the fork's os._exit would skip.
  try:
    threading = sys.modules.get("threading")
    if threading is not None:
      threading._shutdown()  # pylint: disable=protected-access
    atexit._run_exitfuncs()  # pylint: disable=protected-access
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  return code


def _confine(payload: dict, uid: int | None) -> None:
  limits = payload["limits"]
  mb = 1024 * 1024
  _lower(resource.RLIMIT_AS, limits["memory_mb"] * mb, limits["memory_mb"] * mb)
  # SIGXCPU at the limit; SIGKILL a second later if the program ignores it.
  _lower(resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1)
  _lower(resource.RLIMIT_FSIZE, limits["disk_mb"] * mb, limits["disk_mb"] * mb)
  _lower(resource.RLIMIT_CORE, 0, 0)
  _lower(resource.RLIMIT_NOFILE, 256, 256)
  if uid is not None or os.geteuid() != 0:
    # It counts every process and thread of the uid, so a shared uid starts from what
    # that uid runs already.
    base = 0 if uid is not None else _tasks_of(os.getuid())
    _lower(resource.RLIMIT_NPROC, base + limits["max_procs"], base + limits["max_procs"])
  if uid is not None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
  _prctl(_PR_SET_NO_NEW_PRIVS, 1)  # No setuid binary can give root back.
  _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # After setuid, which clears it.
  os.chdir(payload["workdir"])


def _lower(which: int, soft: int, hard: int) -> None:
  """Sets an rlimit, never above the hard limit we were given (only root may raise it)."""
  _, current = resource.getrlimit(which)
  if current != resource.RLIM_INFINITY:
    soft, hard = min(soft, current), min(hard, current)
  resource.setrlimit(which, (soft, hard))


def _tasks_of(uid: int) -> int:
  """How many threads `uid` runs now, the count RLIMIT_NPROC is checked against."""
  count = 0
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
      if int(fields["Uid"].split()[0]) == uid:
        count += int(fields["Threads"])
    except (OSError, KeyError, ValueError):
      pass  # Gone since listdir.
  return count


# Audit events that write or delete a path: event -> ((path arg, dir_fd arg or None), ...).
_PATH_EVENTS = {
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.link": ((0, 2), (1, 3)),
    "os.mkdir": ((0, 2),), "os.remove": ((0, 1),), "os.rename": ((0, 2), (1, 3)),
    "os.rmdir": ((0, 1),), "os.symlink": ((1, 2),), "os.truncate": ((0, None),),
    "os.utime": ((0, 3),), "os.setxattr": ((0, None),), "os.removexattr": ((0, None),),
    "shutil.rmtree": ((0, 1),),
}
# Processes that would run without this hook: the kernel's limits still hold, but a run
# that tries is reported as blocked rather than judged on what the new program did.
_SPAWN_EVENTS = frozenset({"os.exec", "os.posix_spawn", "os.spawn", "os.system",
                           "subprocess.Popen"})
_RESOLVER_EVENTS = frozenset({"socket.getaddrinfo", "socket.gethostbyname",
                              "socket.gethostbyname_ex", "socket.gethostbyaddr",
                              "socket.getnameinfo", "socket.sethostname"})
_ROOT_EVENTS = frozenset({"os.fork", "os.kill", "os.killpg", "resource.setrlimit",
                          "resource.prlimit"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_WRITABLE_DEVICES = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr"})


def _make_hook(workdir: str, marker: int, unconfined: bool):
  """An audit hook that ends the process on a write outside `workdir`, a network socket
  or a new program, after recording why on `marker`.

  If `unconfined` (root, with no uid of its own), it also stops what only the kernel
  would otherwise bound: fork (a fork bomb), signals to other processes, rlimit changes.

  It exits rather than raising, so the program cannot catch the error and carry on as
  if it had been allowed. Functions are bound now, so later monkeypatching of os or
  os.path does not reach the hook.
  """
  realpath, fsdecode, readlink, write, exit_ = (os.path.realpath, os.fsdecode,
                                                 os.readlink, os.write, os._exit)
  dumps, af_unix, devices = json.dumps, socket.AF_UNIX, _WRITABLE_DEVICES
  families = {int(f): f.name for f in socket.AddressFamily}
  me = os.getpid()
  path_events, spawn_events, resolver_events = _PATH_EVENTS, _SPAWN_EVENTS, _RESOLVER_EVENTS

  def outside(path, dir_fd=None) -> bool:
    if isinstance(path, int):
      try:
        path = readlink(f"/proc/self/fd/{path}")
      except OSError:
        return False
      if not path.startswith("/"):
        return False  # A pipe or socket, not a file.
    path = fsdecode(path)
    if path in devices:
      return False
    if isinstance(dir_fd, int) and dir_fd >= 0 and not path.startswith("/"):
      path = readlink(f"/proc/self/fd/{dir_fd}") + "/" + path
    full = realpath(path)
    return full != workdir and not full.startswith(workdir + "/")

  def block(why: str) -> None:
    try:
      write(marker, (dumps({"blocked": why[:300]}) + "\n").encode())
    finally:
      exit_(_EXIT_BLOCKED)

  def hook(event: str, args: tuple) -> None:
    if event == "open":
      path, mode, flags = args
      if isinstance(path, int):
        return  # Wraps an fd opened earlier, by a call this hook already saw.
      writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
          isinstance(flags, int) and flags & _WRITE_FLAGS)
      if writes and outside(path):
        block(f"write outside the working directory: {fsdecode(path)}")
    elif event in path_events:
      for i, j in path_events[event]:
        if outside(args[i], args[j] if j is not None else None):
          block(f"{event} outside the working directory: {args[i]}")
    elif event == "socket.__new__":
      if args[1] != af_unix:
        block(f"network: socket({families.get(args[1], args[1])})")
    elif event in resolver_events:
      block(f"network: {event}({args[0] if args else ''!r})")
    elif event in spawn_events:
      block(f"new process: {event}")
    elif unconfined and event in _ROOT_EVENTS and not (event == "os.kill" and args[0] == me):
      block(f"{event}{args}, refused to root without a uid of its own")

  return hook


def _run(source: str, tests: str | None, nonce: str, marker: int) -> int:
  """Runs `source`, then `tests`, as `__main__`; records how; returns the exit code."""
  record = _recorder(marker)
  main = types.ModuleType("__main__")
  main.__dict__["__builtins__"] = builtins
  sys.modules["__main__"] = main
  sys.argv = ["<program>"]
  stage = "program"
  try:
    program = _compile(source, "<program>")
    checks = None if tests is None else _compile(tests, "<tests>")
    exec(program, main.__dict__)  # pylint: disable=exec-used
    if checks is not None:
      stage = "tests"
      exec(checks, main.__dict__)  # pylint: disable=exec-used
  except SystemExit as e:
    code = _exit_code(e)
    if stage == "program" and tests is not None:
      # Exiting early is the cheapest way to skip the tests, so it fails them.
      print(f"SystemExit({e.code!r}) before the tests ran", file=sys.stderr)
      record({"exc": "SystemExit", "msg": f"exit code {code} before the tests ran"})
      return code or 1
    if code == 0:
      record({"done": nonce})
    return code
  except BaseException as e:  # pylint: disable=broad-except
    try:
      # Our own frame is no part of the program's traceback.
      traceback.print_exception(type(e), e, e.__traceback__.tb_next)
      message = str(e)
    except BaseException:  # pylint: disable=broad-except
      message = "<unprintable>"  # A hostile __str__ does not get to crash the report.
    record({"exc": type(e).__name__, "msg": message[:500]})
    return 1
  record({"done": nonce})
  return 0


def _recorder(marker: int):
  """Returns record(dict), writing to `marker` with functions bound before the program
  runs; a closed or broken pipe loses the record, which can only fail the run."""
  write, dumps = os.write, json.dumps

  def record(what: dict) -> None:
    try:
      write(marker, (dumps(what) + "\n").encode())
    except OSError:
      pass

  return record


def _exit_code(e: SystemExit) -> int:
  """The process exit code `raise SystemExit(e.code)` gives, as the interpreter does."""
  if e.code is None:
    return 0
  if isinstance(e.code, int):
    return e.code & 0xFF
  print(e.code, file=sys.stderr)
  return 1


def _compile(source: str, name: str) -> types.CodeType:
  # Tracebacks show the lines of the program and the tests, as they would for a file.
  linecache.cache[name] = (len(source), None, source.splitlines(True), name)
  return compile(source, name, "exec")


if __name__ == "__main__":
  main(sys.argv)
