"""vLLM's metric names: the agent's (agent/container/protocol.py, which travels without the tool's modules) and
the tool's (vllm_facts.py) agree, and the agent's readers use them."""

from orchestrator.core import vllm_facts as vf
from orchestrator.agent.container import probe, protocol, router


def test_the_agent_and_the_tool_spell_the_metric_names_alike():
    assert protocol.M_DRAFTS == vf.M_DRAFTS
    assert protocol.M_RUNNING == vf.M_RUNNING
    assert protocol.M_REQUEST_SUCCESS == "vllm:request_success"


def test_the_probe_counts_drafts_over_every_engine():
    text = ('vllm:spec_decode_num_drafts_total{engine="0"} 3.0\nvllm:spec_decode_num_drafts{engine="1"} 2\n'
            "vllm:spec_decode_num_drafts_created 5\nvllm:spec_decode_num_draft_tokens_total 40\n")
    assert probe.drafts_total(text) == 5.0


def test_the_router_reads_a_replicas_success_and_running(monkeypatch):
    text = ('vllm:request_success_total{finished_reason="stop"} 4\nvllm:request_success_total{finished_reason='
            '"length"} 1\nvllm:num_requests_running{engine="0"} 2\nvllm:num_requests_waiting 7\n')
    monkeypatch.setattr(router, "http", lambda port, path, timeout, host: (200, text))
    assert router._replica_metrics("http://10.0.0.5:8000") == {"success": 5.0, "running": 2.0}
