"""Screenshot a run's HTML report in headless Chromium (the image in the README).

  .venv/bin/python scripts/screenshot_report.py WORKDIR/report.html docs/report_quickstart.png

Needs Debian's chromium (`apt-get install -y chromium`) and the playwright package (the
test extra); the page is opened offline, as the browser test opens it.
"""

import argparse
import os
import sys

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("report")
  p.add_argument("out")
  p.add_argument("--chromium", default="/usr/bin/chromium")
  p.add_argument("--width", type=int, default=1280)
  args = p.parse_args(argv)
  from playwright.sync_api import sync_playwright

  errors = []
  with sync_playwright() as pw:
    browser = pw.chromium.launch(executable_path=args.chromium, args=ARGS, headless=True)
    try:
      page = browser.new_page(viewport={"width": args.width, "height": 900})
      page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
      page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file://")
                 else r.abort())
      page.goto("file://" + os.path.abspath(args.report))
      page.wait_for_selector("body[data-rendered=true]", timeout=20000)
      page.screenshot(path=args.out, full_page=True)
    finally:
      browser.close()
  for e in errors:
    print(f"console error: {e}", file=sys.stderr)
  print(args.out)
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
