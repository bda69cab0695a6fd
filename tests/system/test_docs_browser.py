"""The docs site as a reader sees it, in a real browser (Debian's ``chromium``, headless), offline: the site is built
(``mkdocs build --strict``, its pictures drawn from real runs by docs/pictures.py, its diagrams by docs/diagrams.py),
served on 127.0.0.1, and three pages are opened: the architecture page, Concepts, and the goodput guide. On each,
every ``<img>`` loaded (``naturalWidth`` > 0), every diagram is an ``<svg>`` (no flowchart left as its source), and the
page asked for nothing off 127.0.0.1 (a report-only content security policy in the page names each such request; the
browser's traffic goes to a proxy that refuses it, so nothing reaches the network — the proxy's record is not the
check, as chromium's own background requests reach it too, but the broken copy's CDN fetch must be in it). The same
checks on a copy of the site with a picture missing and a diagram left as mermaid source (what the page is without
docs/diagrams.py: Material then fetches mermaid from its CDN) find all three faults. Skipped where chromium is not
installed."""

from __future__ import annotations

import functools
import html
import http.server
import json
import os
import re
import shutil
import socketserver
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.browser]  # (make docs-check runs it, not make test)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ROOT = Path(__file__).resolve().parents[2]
PAGES = ("architecture/", "concepts/", "guides/goodput/")
# injected into each page served: once the page has loaded, what the reader got, as JSON in the DOM
CHECK = """<script>window.addEventListener("load", () => setTimeout(() => {
  const flow = /^\\s*(flowchart|graph)\\s+(TD|TB|LR|RL|BT)\\b/m;
  const out = document.createElement("pre"); out.id = "pitstop-check";
  out.textContent = JSON.stringify({
    images: [...document.images].map(i => [i.getAttribute("src"), i.complete ? i.naturalWidth : -1]),
    diagrams: document.querySelectorAll("div.diagram > svg, .mermaid svg").length,
    raw: [...document.querySelectorAll("pre, div.mermaid")].filter(e => flow.test(e.textContent)).length,
    left: window.pitstopLeft,
  });
  document.body.appendChild(out);
}, 1000));</script>"""


# first in each page's head: every request the page makes to another origin, as the browser's content security
# policy (report-only: nothing is blocked by it, the page behaves as it would) sees it
WATCH = """<script>window.pitstopLeft = [];
document.addEventListener("securitypolicyviolation", e => window.pitstopLeft.push(e.blockedURI));</script>"""
POLICY = "default-src 'self' 'unsafe-inline' 'unsafe-eval' data: blob:"


class Site(http.server.SimpleHTTPRequestHandler):
    """The built site, each HTML page with WATCH first in its head and CHECK before ``</body>``, under POLICY."""

    def send_head(self):  # noqa: ANN201 - http.server's
        path = self.translate_path(self.path)
        if os.path.isdir(path):
            path = os.path.join(path, "index.html")
        if not path.endswith(".html") or not os.path.isfile(path):
            return super().send_head()
        text = Path(path).read_text().replace("<head>", "<head>" + WATCH, 1).replace("</body>", CHECK + "</body>")
        body = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Security-Policy-Report-Only", POLICY)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return __import__("io").BytesIO(body)

    def log_message(self, *args: object) -> None:
        pass


class Refusing(socketserver.StreamRequestHandler):
    """A proxy that refuses every request (nothing this test starts reaches the network) and writes down where it
    was going (``CONNECT host:443``, ``GET url``): the page's requests, and the browser's own (updates, sign-in)."""

    def handle(self) -> None:
        line = self.rfile.readline().decode(errors="replace").strip()
        if line:
            self.server.asked.append(line)
        self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


def serve(handler: type, **attrs: object) -> socketserver.TCPServer:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    for k, v in attrs.items():
        setattr(server, k, v)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def opened(site: Path, page: str) -> tuple[dict, list[str]]:
    """What headless chromium got on ``page`` of ``site`` (CHECK's JSON), and what the proxy was asked."""
    web = serve(functools.partial(Site, directory=str(site)))
    proxy = serve(Refusing, asked=[])
    try:
        url = f"http://127.0.0.1:{web.server_address[1]}/{page}"
        # (the browser's own background traffic off: what reaches the proxy is what the page asked for)
        quiet = ["--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-pings",
                 "--disable-default-apps", "--disable-extensions", "--no-first-run"]  # fmt: skip
        cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *quiet,
               f"--proxy-server=http://127.0.0.1:{proxy.server_address[1]}", "--window-size=1400,900",
               "--virtual-time-budget=15000", "--dump-dom", url]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, start_new_session=True)
        assert p.returncode == 0, p.stderr[-2000:]
        found = re.search(r'<pre id="pitstop-check">(.*?)</pre>', p.stdout, re.S)
        assert found, f"{page}: the page never finished loading: {p.stdout[-1000:]}"
        return json.loads(html.unescape(found.group(1))), list(proxy.asked)
    finally:
        web.shutdown()
        proxy.shutdown()


def faults(page: str, got: dict) -> list[str]:
    """What a reader of ``page`` would miss: a picture that did not load, a diagram shown as its source, a request
    for something not on the site (offline it fails)."""
    said = [f"{page}: picture {src} did not load" for src, width in got["images"] if width <= 0]
    said += [f"{page}: a diagram is shown as its source"] * got["raw"]
    return said + [f"{page}: a request left 127.0.0.1: {url}" for url in got["left"]]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run installs it)")
def test_three_pages_show_their_pictures_and_diagrams_offline(site):
    got = {page: opened(site, page) for page in PAGES}
    assert [f for page, (seen, _) in got.items() for f in faults(page, seen)] == []
    assert got["architecture/"][0]["diagrams"] == 2  # (both flowcharts, drawn)
    shown = {page: {os.path.basename(src) for src, _ in seen["images"]} for page, (seen, _) in got.items()}
    assert "timeline-killed-twice.png" in shown["concepts/"]
    assert {"timeline-killed-twice.png", "sweep-report.png"} <= shown["guides/goodput/"]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run installs it)")
def test_the_checks_find_a_missing_picture_a_diagram_left_as_source_and_a_request_out(site, tmp_path):
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    (broken / "pictures" / "sweep-report.png").unlink()
    page = broken / "architecture" / "index.html"
    text = page.read_text()
    # the page as it is built without docs/diagrams.py: superfences' mermaid block, which Material renders with
    # mermaid fetched from its CDN
    text = re.sub(r'<div class="diagram"[^>]*>.*?</svg></div>', '<pre class="mermaid"><code>flowchart TD\n    A --> B\n'
                  '</code></pre>', text, count=1, flags=re.S)  # fmt: skip
    assert "flowchart TD" in text  # (the diagram was replaced)
    page.write_text(text)
    seen = {page: opened(broken, page) for page in ("guides/goodput/", "architecture/")}
    said = [f for page, (got, _) in seen.items() for f in faults(page, got)]
    assert any("unpkg.com" in url for url in seen["architecture/"][1]), seen  # (the proxy was asked for mermaid too)
    assert any("sweep-report.png did not load" in s for s in said), said
    assert any("a diagram is shown as its source" in s for s in said), said
    assert any("a request left 127.0.0.1" in s and "unpkg.com" in s for s in said), said
