"""refitd's /metrics, read by Prometheus' own text-format parser."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from refit_client import RefitClient

from conftest import load_state_dict


def _scrape(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers.get("Content-Type", "").startswith("text/plain")
        text = response.read().decode()
    # Every family must parse; a malformed line raises here.
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(families: dict, family: str, sample: str, **labels: str) -> float:
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {sample}{labels} in {family}")


def test_metrics_parse_as_prometheus_text_and_follow_a_refit(start_daemon, weights):
    daemon = start_daemon("--metrics-listen=127.0.0.1:0")
    line = daemon.wait_for_line("metrics at /metrics")
    address = re.search(r"address=(\S+)", line).group(1)

    before = _scrape(address)
    info = [s for s in before["refitd_build_info"].samples]
    assert len(info) == 1 and info[0].value == 1
    assert re.match(r"\d+\.\d+\.\d+", info[0].labels["version"])

    with RefitClient(daemon.address) as client:
        result = client.push(load_state_dict(weights(2)))
    assert result.version == 2

    after = _scrape(address)
    # The version gauge follows the commit; staging is back to zero; the
    # committed refit and its bytes are counted; the phase histogram has it.
    assert _value(after, "refitd_version", "refitd_version", group="target") == 2
    assert _value(after, "refitd_staging_bytes", "refitd_staging_bytes", group="target") == 0
    committed = [
        s for s in after["refitd_refits"].samples
        if s.name == "refitd_refits_total" and s.labels.get("outcome") == "committed"
    ]
    assert committed and committed[0].value >= 1
    received = after["refitd_bytes_received"].samples[0].value
    assert received >= result.bytes_received > 0
    assert any(s.name == "refitd_phase_seconds_count" and s.value >= 1
               for s in after["refitd_phase_seconds"].samples)
