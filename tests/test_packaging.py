"""What a user installs, and what a bare checkout imports."""

import os
import subprocess
import sys
import sysconfig
import tomllib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def test_pyproject_lists_every_package():
  """A wheel (pip install .) holds only the listed packages: plan/ and envs/ were missing."""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    tool = tomllib.load(f)["tool"]["setuptools"]
  listed = set(tool["packages"])
  where = {name: os.path.join(ROOT, *name.split(".")) for name in listed}
  where.update({k: os.path.join(ROOT, v) for k, v in tool["package-dir"].items()})
  found = set()
  for top, folder in (("jaxrl_post", "jaxrl_post"), ("jaxrl_post.kernels", "kernels"),
                      ("jaxrl_post.sharding", "sharding")):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
      if "__init__.py" in files:
        rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
        found.add(top if rel == "." else top + "." + rel.replace(os.sep, "."))
  assert found == listed
  assert all(os.path.isfile(os.path.join(where[n], "__init__.py")) for n in listed
             if n in where)


def test_a_bare_checkout_imports_kernels_and_sharding(tmp_path):
  """PYTHONPATH=checkout without an install (a GPU host's first run): the top-level
  kernels/ and sharding/ import as jaxrl_post.kernels and jaxrl_post.sharding."""
  code = ("import sys; sys.path.append(sys.argv[1]); "
          "import jaxrl_post.kernels.paged_attention, jaxrl_post.sharding.mesh; "
          "print(sys.modules['jaxrl_post.kernels.paged_attention'].__file__); "
          "print(sys.modules['jaxrl_post.sharding.mesh'].__file__)")
  # -S: no site, so no editable-install finder; site-packages only for jax and numpy.
  done = subprocess.run([sys.executable, "-S", "-c", code, sysconfig.get_paths()["purelib"]],
                        env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
                        cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  paths = done.stdout.split()
  assert paths == [os.path.join(ROOT, "kernels", "paged_attention.py"),
                   os.path.join(ROOT, "sharding", "mesh.py")]


def test_commands_start_without_libtpus_error_block_on_a_host_without_tpus(tmp_path):
  """With libtpu installed (the test and tpu extras) and no TPU, jax printed a block of
  TPU-discovery errors in every command; importing jaxrl_post first keeps libtpu quiet."""
  import importlib.util

  from jaxrl_post import libtpu_plugin

  if libtpu_plugin.has_tpu_hardware():
    return  # A TPU VM: libtpu is the runtime there and is left alone.
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("TPU_", "ALLOW_MULTIPLE_LIBTPU")) and k != "JAX_PLATFORMS"}
  run = lambda code: subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                                    capture_output=True, text=True, timeout=300)
  ours = run("import jaxrl_post, jax; print(jax.devices()[0].platform)")
  assert ours.returncode == 0 and "TPU" not in ours.stderr, ours.stderr[-2000:]
  if importlib.util.find_spec("libtpu") is not None:  # The block this prevents.
    bare = run("import jax; print(jax.devices()[0].platform)")
    assert "TPU" in bare.stderr


def _package(path: str) -> str:
  """The package a source file belongs to: jaxrl_post.<first folder>, kernels or sharding."""
  rel = os.path.relpath(path, ROOT).split(os.sep)
  return rel[0] if rel[0] != "jaxrl_post" else (rel[1] if len(rel) > 2 else "jaxrl_post")


def test_no_module_reaches_into_another_packages_private_names():
  """Packages meet through public names (what plan needs of the engine and the trainer is
  a public seam of theirs), so a private helper can change without breaking a neighbour."""
  import ast
  found = []
  for folder in ("jaxrl_post", "kernels", "sharding"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
      for name in (f for f in files if f.endswith(".py")):
        path = os.path.join(dirpath, name)
        mine, imported = _package(path), {}
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
          if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxrl_post."):
            other = node.module.split(".")[1]
            for alias in node.names:
              imported[alias.asname or alias.name] = other
              if alias.name.startswith("_") and other != mine:
                found.append(f"{path}: from {node.module} import {alias.name}")
        for node in ast.walk(tree):
          if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
              and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
              and imported.get(node.value.id, mine) != mine):
            found.append(f"{path}: {node.value.id}.{node.attr}")
  assert not found, found
