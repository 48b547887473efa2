"""The run report as a person sees it: opened in headless Chromium (Debian's `chromium`),
offline, every plot drawn with data and no console errors.

Needs /usr/bin/chromium (`apt-get install -y chromium`; scripts/test.sh installs it where
it can) and the `playwright` package (the test extra); skipped, saying which is missing,
otherwise. Run it alone: `.venv/bin/python -m pytest -q -m browser tests/test_report_browser.py`.
"""

import os
import shutil

import pytest

from jaxrl_post import report
from tests.report_fixture import write_run

CHROMIUM = os.environ.get("JAXRL_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = pytest.mark.browser


def _chromium():
  if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium, or set "
                f"JAXRL_CHROMIUM)")
  try:
    from playwright.sync_api import sync_playwright
  except ImportError:
    pytest.skip("the playwright package is missing (pip install -e '.[test]')")
  return sync_playwright


def open_report(path: str, screenshot: str | None = None) -> dict:
  """Opens a report file in headless Chromium with the network cut off; what it showed:
  {"points": {plot id: data-points}, "errors": [...], "requests": [non-file URLs]}."""
  sync_playwright = _chromium()
  errors, requests = [], []
  with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
    try:
      page = browser.new_page(viewport={"width": 1400, "height": 1000})
      page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
      page.on("pageerror", lambda e: errors.append(str(e)))

      def route(r):
        if r.request.url.startswith("file://"):
          return r.continue_()
        requests.append(r.request.url)
        return r.abort()

      page.route("**/*", route)
      page.goto("file://" + os.path.abspath(path))
      page.wait_for_selector("body[data-rendered=true]", timeout=20000)
      points = page.eval_on_selector_all(
          ".plot", "els => Object.fromEntries(els.map(e => [e.dataset.plot, "
                   "Number(e.dataset.points)]))")
      shapes = page.eval_on_selector_all(".plot svg path.series, .plot svg rect.bar, "
                                         ".plot svg rect", "els => els.length")
      if screenshot:
        page.screenshot(path=screenshot, full_page=True)
    finally:
      browser.close()
  return {"points": points, "errors": errors, "requests": requests, "shapes": shapes}


def test_every_plot_renders_with_data_and_no_console_errors(tmp_path):
  write_run(tmp_path / "run", steps=3000, total=4000, spike_at=1500, eval_every=100, torn=True)
  path = report.write(str(tmp_path / "run"))
  seen = open_report(path)
  assert seen["errors"] == []
  assert seen["requests"] == []  # Offline: nothing but the file itself was asked for.
  assert set(seen["points"]) == {"reward", "kl", "entropy", "clip", "roles", "ratio", "tokens",
                                 "mfu", "memory", "alarms"}
  assert all(n > 0 for n in seen["points"].values()), seen["points"]
  assert seen["shapes"] > 20
