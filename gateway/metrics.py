"""Gateway metrics. Labels are bounded (R25): outcome words and the fixed
method table only; never a ticket id, a client address or a token."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.logins = Counter("afe_gateway_logins_total", "Login attempts by outcome",
                              ["outcome"], registry=registry)
        self.handshakes = Counter("afe_gateway_rpc_handshakes_total", "/rpc handshakes by outcome",
                                  ["outcome"], registry=registry)
        self.requests = Counter("afe_gateway_rpc_requests_total", "JSON-RPC requests by method and outcome",
                                ["method", "outcome"], registry=registry)
        self.connections = Gauge("afe_gateway_rpc_connections", "Open /rpc connections by credential kind",
                                 ["principal"], registry=registry)
