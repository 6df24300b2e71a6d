"""Per-Model prices and the one cost estimate (services/common/cost.py): the
manifest field, its validation, the estimate, the per-node and per-ticket
totals the UI and `afe ticket show` print, and the bounded usage metrics."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.common import cost
from services.common.config.manifests import load_config
from services.common.errors import ConfigError
from services.common.observability.metrics import UnboundedLabel, usage_metrics

DOCS = """\
kind: Model
name: claude
provider: anthropic
model: claude-x
apiKeyEnv: ANTHROPIC_KEY
{price}---
kind: Model
name: free
provider: replay
script: script.yaml
---
"""


def load(tmp_path, price: str):
    (tmp_path / "script.yaml").write_text("[]\n")
    (tmp_path / "afe.yaml").write_text(DOCS.format(price=price))
    return load_config(tmp_path)


def test_price_loads_and_estimates(tmp_path):
    cfg = load(tmp_path, "price: {input: 3, output: 15.5}\n")
    m = cfg.models["claude"]
    assert m.price == (3.0, 15.5)
    assert cfg.models["free"].price is None
    # 2M in at $3/M + 1M out at $15.5/M
    assert cost.estimate(m, 2_000_000, 1_000_000) == pytest.approx(21.5)
    assert cost.estimate(m, 1000, 0) == pytest.approx(0.003)
    assert cost.estimate(cfg.models["free"], 1000, 1000) is None   # unpriced: unknown, never $0
    assert cost.estimate(None, 1000, 1000) is None
    p = cost.usage_payload("fix", m, "claude", 1000, 2000)
    assert p == {"node": "fix", "model": "claude", "input_tokens": 1000, "output_tokens": 2000,
                 "cost_usd": pytest.approx(0.034)}
    assert "cost_usd" not in cost.usage_payload("fix", None, "free", 10, 10)


@pytest.mark.parametrize("price,where,says", [
    ("price: {input: 3}\n", "price.output", "required"),
    ("price: {input: -1, output: 2}\n", "price.input", "0 or more"),
    ("price: {input: '3', output: 2}\n", "price.input", "US dollars per million tokens"),
    ("price: {input: 3, output: 2, currency: EUR}\n", "price.currency", "allowed here: input, output"),
    ("price: 3\n", "price", "mapping"),
])
def test_bad_price_says_what_to_change(tmp_path, price, where, says):
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, price)
    text = str(exc.value)
    assert where in text and says in text, text


def test_totals_per_node_and_ticket():
    events = [
        {"type": "model.usage", "payload": {"node": "fix", "model": "claude", "input_tokens": 100,
                                            "output_tokens": 10, "cost_usd": 0.5}},
        {"type": "node.output", "payload": {"node": "fix", "text": "x"}},
        {"type": "model.usage", "payload": {"node": "fix", "model": "claude", "input_tokens": 50,
                                            "output_tokens": 5, "cost_usd": 0.25}},
        {"type": "model.usage", "payload": {"node": "review", "model": "free", "input_tokens": 7,
                                            "output_tokens": 3}},
    ]
    t = cost.totals(events)
    assert t["nodes"]["fix"] == {"input_tokens": 150, "output_tokens": 15, "cost_usd": 0.75, "unpriced": False}
    assert t["nodes"]["review"] == {"input_tokens": 7, "output_tokens": 3, "cost_usd": None, "unpriced": True}
    assert t["ticket"] == {"input_tokens": 157, "output_tokens": 18, "cost_usd": 0.75, "unpriced": True}
    assert cost.fmt_usd(None) == "—" and cost.fmt_usd(0.0123) == "$0.0123" and cost.fmt_usd(12.5) == "$12.50"


def test_r25_usage_metrics_take_only_manifest_model_names():
    reg = CollectorRegistry()
    m = usage_metrics(reg, ["claude", "free"])
    m.tokens.labels(model="claude", direction="input").inc(100)
    m.cost.labels(model="claude").inc(0.5)
    text = generate_latest(reg).decode()
    assert 'afe_model_tokens_total{direction="input",model="claude"} 100.0' in text
    assert 'afe_model_cost_usd_total{model="claude"} 0.5' in text
    # Positive control of the bound: a name no manifest declares never becomes a series.
    with pytest.raises(UnboundedLabel):
        m.tokens.labels(model="tkt-123", direction="input")
    with pytest.raises(UnboundedLabel):
        m.cost.labels(model="sk-secret")
