"""What learners see: JupyterLab in a real, headless Chromium runs notebooks top to bottom, then the page is
checked and photographed.

    python tools/browser_check.py                       # notebooks 00, 04 and 06 on tiny
    python tools/browser_check.py notebooks/07_chat.ipynb

Needs Chromium (Debian: apt-get install chromium) and the Playwright package (pip install playwright; its own
browser download is not needed: the system's Chromium is used). JupyterLab listens on loopback with a random
token. Per notebook it checks that every code cell ran, that no cell raised (a traceback on the page), that
every ipywidget rendered as a widget and not as its text form ("VBox(children=...)"), and that every chart
rendered as an image; it keeps screenshots of the widgets and charts, and a summary, in build/browser/.
Exit status 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a clone: helpers without an install
from helpers.mirror import free_port  # noqa: E402
from helpers.paths import BUILD_DIR  # noqa: E402

OUT = BUILD_DIR / "browser"
DEFAULT_NOTEBOOKS = ["notebooks/00_setup.ipynb", "notebooks/04_named_modules.ipynb", "notebooks/06_memory_profiling.ipynb"]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
CELL_TIMEOUT_MS = 900_000
ALL_RAN = """() => {
  const prompts = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt')];
  return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
}"""
FINDINGS = """() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const texts = [...panel.querySelectorAll('.jp-OutputArea-output')].map(o => o.textContent);
  return {
    code_cells: panel.querySelectorAll('.jp-CodeCell').length,
    tracebacks: texts.filter(t => t.includes('Traceback (most recent call last)')).map(t => t.slice(0, 300)),
    widgets_as_text: texts.filter(t => /^\\s*(VBox|HBox|Box|Tab)\\(children=/.test(t)).length,
    widgets: panel.querySelectorAll('.jp-OutputArea-output .jupyter-widgets, .jp-OutputArea-output .widget-container').length,
    images: panel.querySelectorAll('.jp-OutputArea-output img').length,
  };
}"""


def start_lab(port: int, token: str, workdir: Path) -> subprocess.Popen:
    """JupyterLab on loopback over a copy of notebooks/ (the runs never touch the repository's notebooks), with
    autosave off."""
    shutil.copytree(ROOT / "notebooks", workdir / "notebooks")
    # autosave off; every cell rendered (JupyterLab 4 detaches cells outside the window, which would hide their
    # outputs from the checks); no news pop-up over the screenshots
    for extension, plugin, value in (("docmanager-extension", "plugin", {"autosave": False}),
                                     ("notebook-extension", "tracker", {"windowingMode": "none"}),
                                     ("apputils-extension", "notification", {"fetchNews": "false"})):
        folder = workdir / "lab-settings" / "@jupyterlab" / extension
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{plugin}.jupyterlab-settings").write_text(json.dumps(value))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
           "JUPYTERLAB_SETTINGS_DIR": str(workdir / "lab-settings")}
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--ServerApp.port={port}", "--ServerApp.ip=127.0.0.1",
               f"--IdentityProvider.token={token}", "--LabApp.expose_app_in_browser=True", f"--ServerApp.root_dir={workdir}",
               "--ServerApp.open_browser=False", *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])]
    lab = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
            return lab
        except OSError:
            time.sleep(0.5)
    lab.terminate()
    raise RuntimeError("JupyterLab did not start within 120 s")


def check_notebook(page, base: str, token: str, notebook: str) -> dict:
    started = time.monotonic()
    page.goto(f"{base}/lab/tree/{notebook}?token={token}")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.sessionContext"
                           " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                           " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel", timeout=120_000)
    page.wait_for_timeout(2000)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(ALL_RAN, timeout=CELL_TIMEOUT_MS, polling=1000)
    page.wait_for_timeout(3000)  # late widget views and images settle
    found = page.evaluate(FINDINGS)
    stem = Path(notebook).stem
    shots = []
    visible = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output"  # this notebook's tab, not earlier ones
    for kind, selector in (("widget", f"{visible} .jupyter-widgets"), ("chart", f"{visible} img")):
        for i, element in enumerate(page.query_selector_all(selector)[:6]):
            path = OUT / f"{stem}-{kind}-{i + 1}.png"
            try:
                element.scroll_into_view_if_needed(timeout=10_000)
                element.screenshot(path=str(path), timeout=20_000)
                shots.append(path.name)
            except Exception as err:  # noqa: BLE001 - a screenshot that fails is reported, the check goes on
                shots.append(f"{path.name}: not taken ({type(err).__name__})")
    page.screenshot(path=str(OUT / f"{stem}-page.png"))
    found.update(notebook=notebook, seconds=round(time.monotonic() - started, 1), screenshots=shots)
    # hand the kernel back and close the tab, as a learner should before the next notebook
    page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()"
                  ".then(() => window.jupyterapp.shell.currentWidget.dispose())")
    return found


def verdict(found: dict, expect_widgets: bool, expect_images: bool) -> list:
    problems = [f"a cell raised: {t}" for t in found["tracebacks"]]
    if found["widgets_as_text"]:
        problems.append(f"{found['widgets_as_text']} widget(s) shown as text, not as a widget")
    if expect_widgets and not found["widgets"]:
        problems.append("no widget rendered")
    if expect_images and not found["images"]:
        problems.append("no chart rendered")
    return problems


def main(argv) -> int:
    from playwright.sync_api import sync_playwright

    notebooks = argv or DEFAULT_NOTEBOOKS
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("No Chromium found: apt-get install chromium (Debian) and run again.", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    port, token = free_port(), secrets.token_hex(16)
    workdir = Path(tempfile.mkdtemp(prefix="browser-check-"))
    lab = start_lab(port, token, workdir)
    results = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            for notebook in notebooks:
                source = json.loads((ROOT / notebook).read_text())
                code = "".join("".join(c["source"]) for c in source["cells"] if c["cell_type"] == "code")
                found = check_notebook(page, f"http://127.0.0.1:{port}", token, notebook)
                found["problems"] = verdict(found, "explorer(" in code or "Chat(" in code, "charts." in code)
                results.append(found)
                print(f"{notebook}: {found['code_cells']} code cells, {found['widgets']} widget(s), {found['images']} "
                      f"chart(s), {found['seconds']} s: {'; '.join(found['problems']) or 'ok'}", flush=True)
            browser.close()
    finally:
        lab.terminate()
        lab.wait(30)
        shutil.rmtree(workdir, ignore_errors=True)
    (OUT / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"screenshots and summary in {OUT}")
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
