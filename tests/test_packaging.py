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
