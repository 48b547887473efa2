"""The mark of every test file whose tests start sandboxed programs: they run in one worker.

tests/rewards/test_sandbox.py's clean_machine counts the machine's sandbox processes
before and after each test, and another worker's would pass for that test's leftovers.
"""

import pytest

SANDBOXED = pytest.mark.xdist_group("sandboxed")
