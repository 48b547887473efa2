"""run_program: hostile programs stopped and classified, and nothing of a run left behind."""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from jaxrl_post.rewards.sandbox import (EXCERPT_CHARS, STATUSES, UID_BASE, Limits, Result,
                                        run_program)
from jaxrl_post.rewards.sandbox_cases import ESCAPE_PATHS, HOSTILE, LIMITS
from tests.rewards.sandboxed import SANDBOXED

pytestmark = SANDBOXED  # One worker: see tests/rewards/sandboxed.py.

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOOT = os.path.join(REPO, "jaxrl_post", "rewards", "sandbox_boot.py").encode()
LAYERS = {"netns", "pidns", "mntns", "ipcns", "utsns", "procfs", "readonly",
          "readonly-partial", "tmpfs", "uid", "nproc"}


def run(source, tests=None, **limits):
  return run_program(source, tests, limits=Limits(**{"timeout_s": 2.0, "memory_mb": 256,
                                                     **limits}))


# ---------------------------------------------------------------------------------------
# What a run may leave behind: processes, temporary directories, memory.


MULTIPROCESSING_HELPERS = (b"multiprocessing.forkserver", b"multiprocessing.resource_tracker")


def sandbox_processes() -> list[str]:
  """Processes of our runs: the boot script's (and its forks'), or our own children.

  Not "any sandbox uid": other checkouts on this machine may be running sandboxes."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read()
      with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
      continue  # Gone since listdir.
    uid, ppid = int(status["Uid"].split()[0]), int(status["PPid"])
    if any(helper in cmdline for helper in MULTIPROCESSING_HELPERS):
      continue  # Live as long as this interpreter once a verifier pool has run in it.
    if BOOT in cmdline.split(b"\0") or ppid == os.getpid():
      found.append(f"{pid} uid={uid} ppid={ppid} {cmdline[:80]!r}")
  return found


def memory_mb() -> dict[str, float]:
  """What a run could leave behind in memory: tmpfs/shm pages, and our own RSS.

  Not MemAvailable: other work on this machine moves it by gigabytes; no process of a
  run is left (checked first), so what remains is kernel objects and the caller.
  """
  with open("/proc/meminfo") as f:
    shmem = next(int(l.split()[1]) for l in f if l.startswith("Shmem:"))
  with open("/proc/self/status") as f:
    rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
  return {"shmem": shmem / 1024, "rss": rss / 1024}


def settle(check, seconds=3.0):
  """Polls `check()` until it returns a falsy value; returns the last value."""
  give_up = time.monotonic() + seconds
  while (value := check()) and time.monotonic() < give_up:
    time.sleep(0.05)
  return value


@pytest.fixture
def clean_machine(tmp_path, monkeypatch):
  """Asserts that the test leaves no sandbox process, directory or memory behind.

  Runs make their directories in `tmp_path`, which pytest makes 0700: the program's uid
  has to be let through to its own directory and no further.
  """
  for path in ESCAPE_PATHS:
    if os.path.exists(path):
      os.remove(path)  # From some earlier, broken version; the test must start clean.
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  assert settle(sandbox_processes) == [], "sandbox processes before the test"
  before = memory_mb()
  yield
  assert settle(sandbox_processes) == []
  assert os.listdir(tmp_path) == []
  grew = lambda: {k: v - before[k] for k, v in memory_mb().items() if v - before[k] > 64}
  assert settle(grew) == {}  # A run's tmpfs is 64 MB, its output at most 1 MB.
  for path in ESCAPE_PATHS:
    assert not os.path.exists(path), f"a run wrote {path}"


# ---------------------------------------------------------------------------------------
# Ordinary programs.


def test_ok_run_reports_stdout_and_isolation(clean_machine):
  r = run("import sys\nprint('hello')\nprint('warn', file=sys.stderr)")
  assert (r.status, r.returncode, r.stdout, r.stderr) == ("ok", 0, "hello\n", "warn\n")
  assert r.reason == "ran to the end" and 0 < r.seconds < 2
  assert set(r.isolation) <= LAYERS


@pytest.mark.parametrize("source, reason", [
    ("def f(x):\n  return 1 / x\nf(0)", "ZeroDivisionError: division by zero"),
    ("def f(:\n  pass", "SyntaxError"),
    ("import sys\nsys.exit(3)", "exit code 3"),
])
def test_errors_fail_with_one_line_reason(source, reason):
  r = run(source)
  assert r.status == "failed" and r.reason.startswith(reason), r
  assert r.returncode != 0 and "\n" not in r.reason


HUMANEVAL_TESTS = """
def check(candidate):
  assert candidate(2, 3) == 5
  assert candidate(-1, 1) == 0, "negatives"

check(add)
"""


@pytest.mark.parametrize("body, status, reason", [
    ("return a + b", "ok", "ran to the end and passed the tests"),
    ("return a - b", "failed", "AssertionError"),
    ("return a + b if a > 0 else 7", "failed", "AssertionError: negatives"),
])
def test_humaneval_style_tests(body, status, reason):
  r = run(f"def add(a, b):\n  {body}\n", HUMANEVAL_TESTS)
  assert (r.status, r.reason) == (status, reason), r
  if status == "failed":
    assert 'File "<tests>", line' in r.stderr and "in check\n    assert" in r.stderr


def test_program_may_write_in_its_own_directory(clean_machine):
  r = run("import os, tempfile\nopen('a.txt', 'w').write('x' * 10)\nos.mkdir('d')\n"
          "with tempfile.TemporaryFile() as f:\n  f.write(b'y')\n"
          "print(sorted(os.listdir('.')), open('a.txt').read())")
  assert r.status == "ok", r
  assert r.stdout.startswith("['a.txt', 'd'") and "xxxxxxxxxx" in r.stdout


def test_environment_payload_and_other_files_are_out_of_reach(monkeypatch):
  monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2")
  r = run("import os, glob\nprint(sorted(os.environ))\n"
          "print(glob.glob('../*'), glob.glob('/tmp/jaxrl-sandbox-*/payload.json'))\n"
          "print(len(os.listdir('/tmp')))")
  assert r.status == "ok", r
  assert "SANDBOX_TEST_SECRET" not in r.stdout and "hunter2" not in r.stdout
  assert "payload" not in r.stdout  # The nonce that marks a finished run stays hidden.
  if "mntns" in r.isolation:
    assert r.stdout.splitlines()[-1] == "1"  # Its own directory, none of the others.


def test_long_output_is_excerpted():
  r = run("for i in range(20000):\n  print(i)")
  assert r.status == "ok", r
  assert len(r.stdout) < EXCERPT_CHARS + 100 and "chars cut" in r.stdout
  assert r.stdout.startswith("0\n1\n") and r.stdout.endswith("19998\n19999\n")


def test_cpu_limit_stops_a_busy_loop_before_the_wall_limit():
  r = run("while True:\n  pass", timeout_s=10.0, cpu_s=1)
  assert r.status == "timeout" and "CPU" in r.reason, r
  assert r.seconds < 5


def test_concurrent_runs_from_threads(clean_machine):
  results = [None] * 4

  def work(i):
    results[i] = run(f"print({i} * {i})")

  threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert [(r.status, r.stdout) for r in results] == [("ok", f"{i * i}\n") for i in range(4)]


def test_program_sees_only_its_own_processes_as_its_own_uid():
  r = run("import os\nprint(os.getuid())\n"
          "print(os.getpid(), sorted(p for p in os.listdir('/proc') if p.isdigit()))")
  assert r.status == "ok", r
  uid, processes = r.stdout.splitlines()
  if "uid" in r.isolation:
    assert int(uid) >= UID_BASE
  if "pidns" not in r.isolation or "procfs" not in r.isolation:
    pytest.skip(f"no PID namespace here: {r.isolation}")
  assert processes == "2 ['1', '2']", r  # init and the program itself.


# ---------------------------------------------------------------------------------------
# Hostile programs.


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_is_stopped_and_leaves_nothing(name, clean_machine):
  case = HOSTILE[name]
  r = run_program(case.source, case.tests, limits=LIMITS)
  if case.needs is not None and case.needs not in r.isolation:
    for path in ESCAPE_PATHS:  # Nothing here stops ctypes: clean up, then skip.
      if os.path.exists(path):
        os.remove(path)
    pytest.skip(f"{name} needs {case.needs}; this OS gave {r.isolation}")
  print(f"\n{name}: {r.status} after {r.seconds:.3f} s ({r.reason})")
  assert r.status in case.statuses, r
  assert r.seconds < LIMITS.timeout_s + 1.5  # Stopped promptly, cleanup included.


@pytest.mark.parametrize("name", ["fork_bomb", "network", "write_tmp", "write_repo",
                                  "subprocess", "orphan_daemon"])
def test_hostile_program_without_namespaces(name, clean_machine):
  # The hook alone (root without a uid of its own also has no process limit, so it
  # refuses forks): the outcome must not depend on what the OS allows.
  case = HOSTILE[name]
  limits = Limits(timeout_s=LIMITS.timeout_s, memory_mb=256, namespaces=False)
  r = run_program(case.source, case.tests, limits=limits)
  assert not {"netns", "pidns", "mntns"} & set(r.isolation)
  assert r.status in case.statuses, r


# ---------------------------------------------------------------------------------------
# Arguments and the CLI.


@pytest.mark.parametrize("kwargs, message", [
    ({"timeout_s": 0}, "Limits.timeout_s must be a positive number, got 0"),
    ({"memory_mb": 8}, "Limits.memory_mb must be an int >= 32, got 8"),
    ({"max_procs": 2.5}, "Limits.max_procs must be an int >= 1, got 2.5"),
    ({"cpu_s": 0}, "Limits.cpu_s must be an int >= 1, got 0"),
])
def test_bad_limits_are_one_line_errors(kwargs, message):
  with pytest.raises(ValueError, match=f"^{message}$"):
    Limits(**kwargs)


def test_bad_arguments_to_run_program():
  with pytest.raises(TypeError, match="needs limits=Limits"):
    run_program("print(1)", limits={"timeout_s": 1})
  with pytest.raises(TypeError, match="needs str source"):
    run_program(b"print(1)", limits=LIMITS)


def cli(*args, stdin="print('hi')"):
  return subprocess.run([sys.executable, "-m", "jaxrl_post.rewards.run_code", *args],
                        input=stdin, capture_output=True, text=True, cwd=REPO, timeout=60)


def test_cli_prints_one_json_object(tmp_path):
  tests = tmp_path / "tests.py"
  tests.write_text("assert double(4) == 8\n")
  p = cli("--timeout-s", "2", "--memory-mb", "256", "--tests", str(tests),
          stdin="def double(x):\n  return 2 * x\nprint('ran')\n")
  assert p.returncode == 0, p.stderr
  out = json.loads(p.stdout)
  assert set(out) >= {"status", "reason", "stdout", "stderr", "seconds", "returncode"}
  assert (out["status"], out["stdout"], out["returncode"]) == ("ok", "ran\n", 0)
  assert Result(**{**out, "isolation": tuple(out["isolation"])}).status in STATUSES


def test_cli_exit_code_is_zero_when_the_program_fails():
  p = cli("--timeout-s", "1", "--memory-mb", "256", stdin="while True:\n  pass\n")
  assert p.returncode == 0 and json.loads(p.stdout)["status"] == "timeout"


@pytest.mark.parametrize("args, message", [
    (["--memory-mb", "256"], "the following arguments are required: --timeout-s"),
    (["--timeout-s", "-1", "--memory-mb", "256"], "Limits.timeout_s must be a positive"),
    (["--timeout-s", "1", "--memory-mb", "256", "--tests", "/nonexistent/t.py"],
     "cannot read the input"),
])
def test_cli_bad_arguments_are_one_line(args, message):
  p = cli(*args)
  assert p.returncode == 2 and p.stdout == ""
  assert p.stderr.count("\n") == 1 and message in p.stderr, p.stderr
