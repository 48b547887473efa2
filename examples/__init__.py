"""Worked examples of extending jaxrl_post from outside the package (not installed with it).

Run them from the repository root, where `python -m` puts this folder's parent on sys.path:
see examples/my_task/.
"""
