"""qvg-app in a real headless Chromium (Debian's, driven by playwright): start `python -m qvg.app.ui`, load the page,
see the per-chunk table's headers, try a bad block size (one error message in the status line, no pop-up), switch
to Self-Forcing and back (the length and live image follow), add an action with the keyboard, start a compare-mode
generation, see a second page wait in the queue with its
position, cancel there and press Generate again (the cancelled job never runs, the new one does), watch the live
frame change chunk by chunk, wait for the end, check the memory panel (summary, the plots drawn in the browser, the
table with PSNR and both videos' bytes by component), and save a screenshot.

The screenshot goes to the test's tmp folder; `QVG_UI_SCREENSHOT=docs/ui-screenshot.png` also writes it there (how
the committed docs/ui-screenshot.png is made). Without a chromium binary the test is skipped, except under CI
(CI=true), where .ci/run installs one: there a missing browser fails.
"""
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from optional_deps import missing, need

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    missing("no chromium on PATH", "Debian: apt-get install chromium; .ci/run installs it")


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    for module in ("gradio", "playwright"):  # (the test extra: CI has them; the bare GPU image does not)
        need(module, "pip install -e '.[test]'")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tmp_path_factory.mktemp("app-tmp")  # (its temp folders: what the server leaves when stopped is seen)
    proc = subprocess.Popen([sys.executable, "-m", "qvg.app.ui", "--port", str(port), "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    url = f"http://127.0.0.1:{port}/"
    t0 = time.time()
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() - t0 > 90:
                proc.kill()
                pytest.fail(f"qvg-app did not start: {proc.stdout.read()[-2000:]}")
            time.sleep(0.3)
    yield url
    proc.terminate()  # SIGTERM (kill, docker stop, systemd): the last job's folder went with it only on Ctrl-C
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("qvg-app did not stop on SIGTERM within 30 s")
    out = proc.stdout.read()
    assert proc.returncode == 143 and "qvg-app: terminated" in out, out[-2000:]
    assert not list(tmp.glob("qvg-app-*")), "qvg-app left its job folder behind on SIGTERM"


def test_page_generates_live_and_screenshot(app_url, tmp_path):
    browser = _chromium()
    sync_api = need("playwright.sync_api", "pip install -e '.[test]'")
    t_start = time.time()
    with sync_api.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=browser,
                                                    headless=True, args=CHROMIUM_FLAGS,
                                                    viewport={"width": 1800, "height": 1100})
        page = ctx.new_page()
        page.goto(app_url, wait_until="domcontentloaded")  # (gradio keeps connections open)
        page.wait_for_selector("#qvg-generate", timeout=60000)
        head = page.locator("#qvg-table").inner_text()
        assert "chunk" in head and "qvg codes KiB" in head, head  # real headers before any run
        seed = page.locator("#qvg-seed textarea, #qvg-seed input").first  # a form error: the click's notice,
        seed.fill("abc")  # at once and nothing queued (the status line is the running video's)
        page.click("#qvg-generate")
        page.wait_for_function("() => document.querySelector('#qvg-notice').innerText.includes('Error:')",
                               timeout=30000)
        assert "seed must be" in page.locator("#qvg-notice").inner_text()
        assert page.locator("#qvg-status").inner_text() == "Ready." and page.locator(".toast-body").count() == 0
        seed.fill("0")
        block = page.locator("#qvg-block textarea, #qvg-block input").first
        block.fill("48")
        page.click("#qvg-generate")
        page.wait_for_function("() => document.querySelector('#qvg-status').innerText.includes('Error:')",
                               timeout=60000)
        status = page.locator("#qvg-status").inner_text()
        assert "not divisible by block_size=48" in status and "Traceback" not in status, status
        assert page.locator(".toast-body").count() == 0  # the message is the status line, not a pop-up
        block.fill("")
        frames = page.locator("#qvg-frames input[type=number]").first
        page.get_by_label("Self-Forcing (checkpoint)").check()
        page.wait_for_function("() => document.querySelector('#qvg-frames input[type=number]').value === '49'",
                               timeout=10000)
        page.wait_for_function("() => !document.querySelector('#qvg-live img')", timeout=10000)
        page.get_by_label("embedded world model").check()
        page.wait_for_function("() => document.querySelector('#qvg-frames input[type=number]').value === '31'",
                               timeout=10000)
        page.wait_for_selector("#qvg-live img", timeout=10000)  # the start frame again
        actions = page.locator("#qvg-actions textarea, #qvg-actions input").first
        actions.fill("right,zoom_in")
        page.locator("body").click(position={"x": 5, "y": 5})  # focus off the field: keys go to the page
        page.keyboard.press("ArrowLeft")
        page.wait_for_function("() => document.querySelector('#qvg-actions textarea, #qvg-actions input')"
                               ".value.endsWith(',left')", timeout=10000)
        frames.fill("10")
        frames.press("Enter")
        page.locator("#qvg-compare input[type=checkbox]").check()
        page.click("#qvg-generate")
        # a second user (another page, another session) waits in the queue, sees its position, and cancels
        other = ctx.new_page()
        other.goto(app_url, wait_until="domcontentloaded")
        other.wait_for_selector("#qvg-generate", timeout=60000)
        other.click("#qvg-generate")
        other.wait_for_function("() => document.querySelector('#qvg-status').innerText.includes('queue: 1/1')",
                                timeout=30000)
        other.click("#qvg-cancel")
        other.wait_for_function("() => document.querySelector('#qvg-status').innerText.includes('will not run')",
                                timeout=10000)
        other_frames = other.locator("#qvg-frames input[type=number]").first
        other_frames.fill("4")
        other_frames.press("Enter")
        other.click("#qvg-generate")  # a new job: the Cancel before it does not reach it
        srcs, deadline = set(), time.time() + 240
        status, seen_other = "", set()
        while time.time() < deadline:
            img = page.locator("#qvg-live img")
            if img.count():
                srcs.add(img.first.get_attribute("src"))
            status = page.locator("#qvg-status").inner_text()
            seen_other.add(other.locator("#qvg-status").inner_text())
            if "done:" in status or "Error:" in status:
                break
            time.sleep(0.2)
        assert "done: 3 chunks" in status, status
        srcs.add(page.locator("#qvg-live img").first.get_attribute("src"))
        assert len(srcs - {None}) >= 4, srcs  # the start preview, then a new image per chunk
        memory = page.locator("#qvg-memory").inner_text()
        assert "Chunk 3 of 3" in memory and "PSNR qvg vs bf16" in memory and "smaller" in memory
        assert "UI between chunks" in memory, memory
        for name in ("components", "kv", "ratio", "latency", "psnr"):  # drawn here by Vega, as SVG
            page.wait_for_selector(f"#qvg-plot-{name} svg .mark-{'rect' if name == 'components' else 'line'} path",
                                   state="attached", timeout=20000)
        page.wait_for_selector("#qvg-video video", timeout=20000)
        table = page.locator("#qvg-table").inner_text()
        assert "right" in table and "zoom_in" in table and "left" in table
        for col in ("PSNR dB", "bf16 bf16_pending KiB", "qvg codes KiB", "qvg workspace KiB", "UI s"):
            assert col in table, (col, table[:500])
        # the PSNR column is in view (not scrolled off to the right)
        box, cell = page.locator("#qvg-table").bounding_box(), page.get_by_text("PSNR dB").first.bounding_box()
        assert box["x"] <= cell["x"] and cell["x"] + cell["width"] <= box["x"] + box["width"], (box, cell)
        # the cancelled 31-frame job ends at its turn without running (no 'of 10' chunk); the one after it runs
        deadline = time.time() + 60
        while not any("done: 1 chunk in" in s for s in seen_other) and time.time() < deadline:
            seen_other.add(other.locator("#qvg-status").inner_text())
            time.sleep(0.1)
        assert any("done: 1 chunk in" in s for s in seen_other) and not any("of 10" in s for s in seen_other), \
            seen_other
        shot = tmp_path / "ui-screenshot.png"
        page.screenshot(path=str(shot), full_page=True)
        ctx.close()
    assert shot.stat().st_size > 20000
    if os.environ.get("QVG_UI_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["QVG_UI_SCREENSHOT"])
    print(f"browser test: {time.time() - t_start:.1f} s, screenshot {shot}")
