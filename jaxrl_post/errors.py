"""User-facing errors.

Anything a user can cause (a wrong name, a missing or corrupt file, a value out of range) is
raised as a `UserError` whose message is one line naming the file, field or value at fault.
Entry points print that line and exit with status 2 instead of showing a stack trace.
"""

import os


class UserError(Exception):
  """An error caused by the user's input, reported as a single line."""

  def __init__(self, message: str):
    super().__init__(" ".join(str(message).split()))


def make_directory(path: str, flag: str) -> None:
  """Creates `path` (and its parents) for a command's output; a UserError naming the flag
  when it is a file or cannot be created."""
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:  # A file in its place or on its way, no permission, a full disk.
    raise UserError(f"{flag}={path}: cannot be used as a directory "
                    f"({e.strerror or e}: {e.filename or path})") from e
