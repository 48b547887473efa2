"""The benchmark scripts under scripts/ loaded as modules, for tests that call their
functions (scripts/ is not a package)."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name: str):
  """scripts/<name>.py executed afresh as module `name`. It is registered in sys.modules
  first: dataclasses look their module up while it loads, and a script may import
  another by name (bench_async imports bench_step: load that one first)."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts",
                                                                   f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module
