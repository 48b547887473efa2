"""User-facing errors.

Anything a user can cause (a wrong name, a missing or corrupt file, a value out of range) is
raised as a `UserError` whose message is one line naming the file, field or value at fault.
Entry points print that line and exit with status 2 instead of showing a stack trace.
"""


class UserError(Exception):
  """An error caused by the user's input, reported as a single line."""

  def __init__(self, message: str):
    super().__init__(" ".join(str(message).split()))
