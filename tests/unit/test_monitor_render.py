"""`deploy monitor render`: the exported dashboard's queries against a tiny Prometheus-shaped HTTP server on
127.0.0.1 (real HTTP, fixed data), drawn by matplotlib: a valid PNG that matplotlib reads back, panels without
data named, a failing query named with its panel, expr and what the server answered."""

import json
import os
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from orchestrator.observe import monitor as MON
from orchestrator.observe import monitor_render as R
from orchestrator.core.errors import Unreachable, UsageError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Fake:
    """Answers query_range: acceptance and tokens/s with data, `up` with an error, everything else empty."""

    def __init__(self):
        self.queries = []
        me = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                u = urllib.parse.urlsplit(self.path)
                q = urllib.parse.parse_qs(u.query)
                if u.path != "/api/v1/query_range":
                    return self._send(404, {"status": "error", "errorType": "not_found", "error": u.path})
                expr, start, end, step = q["query"][0], float(q["start"][0]), float(q["end"][0]), float(q["step"][0])
                me.queries.append(expr)
                if expr.startswith("up{"):
                    return self._send(400, {"status": "error", "errorType": "bad_data",
                                            "error": "parse error: unexpected character"})
                result = []
                if MON.ACCEPTED in expr or MON.GEN_TOKENS in expr:
                    n = int((end - start) // step) + 1
                    for vmid, base in (("129", 3.2), ("130", 1.4)):
                        result.append({"metric": {"host": "pve1", "vmid": vmid, "playbook": "qwen36-dflash"},
                                       "values": [[start + i * step, str(base + 0.01 * i)] for i in range(n)]})
                self._send(200, {"status": "success", "data": {"resultType": "matrix", "result": result}})

            def _send(self, code, doc):
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *a):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def dash(tmp_path):
    p = tmp_path / "dashboard.json"
    p.write_text(json.dumps(MON.dashboard()))
    return str(p)


def test_render_draws_a_png_that_reads_back_and_names_panels_without_data(dash, tmp_path):
    import matplotlib.image

    out = str(tmp_path / "d.png")
    with Fake() as f:
        res = R.render(dash, f.url, out, since=600, step=10, scrape=15)
    with open(out, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(out)
    assert img.shape[0] > 500 and img.shape[1] > 1000
    titles = [p["title"] for p in MON.dashboard()["panels"]]
    assert res["panels"] == titles
    assert res["no_data"] == [t for t in titles if not t.startswith(("Acceptance length", "Generated", "Scrape"))]
    assert res["series"] == 4
    # the variables match everything; $__rate_interval is Grafana's max(step + scrape, 4 x scrape) = 60s
    assert all("$" not in q for q in f.queries) and any('host=~".*"' in q and "[60s]" in q for q in f.queries)
    assert res["failed"] == [{"panel": "Scrape up (1) / down (0)", "expr": 'up{job="vllm-pve-deploy",host=~".*",'
                              'playbook=~".*"}', "error": "HTTP 400: bad_data: parse error: unexpected character"}]


def test_cli_exit_codes_and_messages(dash, tmp_path):
    env = dict(os.environ, NO_COLOR="1")
    cmd = [sys.executable, "-m", "orchestrator.cli"]
    out = str(tmp_path / "d.svg")
    with Fake() as f:
        p = subprocess.run(cmd + ["monitor", "render", dash, "--prometheus", f.url, "--since", "5m", "--out", out,
                                  "--var", "playbook=qwen36-dflash"], capture_output=True, text=True, env=env,
                           cwd=REPO, timeout=120)
        assert 'playbook=~"qwen36-dflash"' in " ".join(f.queries)
    assert p.returncode == 1, p.stderr  # a query failed: the picture is still written, the panel named
    assert "wrote " in p.stdout and "no data: Acceptance per draft position" in p.stdout
    assert "panel 'Scrape up (1) / down (0)': query failed: HTTP 400: bad_data" in p.stderr
    assert 'expr: up{job="vllm-pve-deploy"' in p.stderr
    assert open(out).read(200).lstrip().startswith("<?xml")
    # bad usage: 2, before any query
    for args, msg in ((["--out", str(tmp_path / "x.gif")], "suffix"), (["--out", out, "--since", "soon"],
                                                                        "not a duration"),
                      (["--out", out, "--var", "x"], "NAME=VALUE")):
        p = subprocess.run(cmd + ["monitor", "render", dash, "--prometheus", "http://127.0.0.1:9"] + args,
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
        assert p.returncode == 2 and msg in p.stderr, (args, p.stderr)
    # nobody listening: 3, said where
    p = subprocess.run(cmd + ["monitor", "render", dash, "--prometheus", "http://127.0.0.1:9", "--out",
                              str(tmp_path / "n.png")], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert p.returncode == 3 and "Prometheus at http://127.0.0.1:9 does not answer" in p.stderr
    assert not (tmp_path / "n.png").exists()


def test_substitution_and_legends():
    e = R.substitute('rate(x{host=~"$host",p=~"${playbook}"}[$__rate_interval]) [[host]]', {"host": ".*",
                     "playbook": "a|b"}, step=30, span=900, scrape=15)
    assert e == 'rate(x{host=~".*",p=~"a|b"}[60s]) .*'
    assert R.substitute("x[$__rate_interval]", {}, step=60, span=3600, scrape=15) == "x[75s]"
    assert R.legend("{{playbook}} {{host}}/{{vmid}} pos {{position}}", {"host": "h", "vmid": "1", "playbook": "p",
                                                                         "position": "0"}) == "p h/1 pos 0"
    assert R.legend(None, {"__name__": "up", "job": "j"}) == 'up{job="j"}'
    assert R.seconds("1h30m", "--since") == 5400 and R.seconds("90", "--step") == 90
    with pytest.raises(UsageError):
        R.seconds("-1", "--step")
    with pytest.raises(Unreachable):
        R.query_range("http://127.0.0.1:9", "up", 0, 1, 1)
