"""Imports from a source checkout that was never installed (PYTHONPATH=checkout).

kernels/ and sharding/ sit at the checkout's top level and install into this package
(pyproject's package-dir). An install maps them; a bare checkout does not, so a GPU or TPU
host with the requirements but no `pip install -e .` failed at the first import of
`jaxrl_post.kernels`. This finder maps the same two names to the same folders, and only
when no installed finder did (it is consulted last).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TOP_LEVEL = ("kernels", "sharding")  # as pyproject's [tool.setuptools] package-dir maps them


class CheckoutFinder(importlib.abc.MetaPathFinder):

  def __init__(self, package: str, root: str):
    self.package, self.root = package, root

  def find_spec(self, fullname, path=None, target=None):
    parent, _, name = fullname.rpartition(".")
    if parent != self.package or name not in TOP_LEVEL:
      return None
    folder = os.path.join(self.root, name)
    return importlib.util.spec_from_file_location(
        fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])


def install(package: str, package_dir: str) -> None:
  """Appends the finder when `package_dir` lies in a checkout (pyproject.toml beside it)."""
  root = os.path.dirname(os.path.abspath(package_dir))
  if not os.path.isfile(os.path.join(root, "pyproject.toml")):
    return
  if not all(os.path.isfile(os.path.join(root, n, "__init__.py")) for n in TOP_LEVEL):
    return
  if not any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
    sys.meta_path.append(CheckoutFinder(package, root))
