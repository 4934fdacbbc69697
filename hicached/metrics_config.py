"""The ``[metrics]`` section: where Prometheus scrapes the daemon and who may
(docs/operations.md, Metrics). A section of hicached.config, which names it as
its own.

Who may scrape matters once ``[tenants]`` is set: the metrics carry every
tenant's name and figures, and a loopback port is open to every local user,
every tenant's included. With tenants, a scrape needs a credential (a bearer
token, or a client certificate); without one configured, every scrape is
refused (daemon/metrics_http.py)."""

from __future__ import annotations

import ipaddress

import msgspec

__all__ = ["MetricsConfig"]

_Section = {"kw_only": True, "forbid_unknown_fields": True}


class MetricsConfig(msgspec.Struct, **_Section):
    """Prometheus metrics over HTTP at /metrics (docs/operations.md)."""

    # Serve metrics at all.
    enabled: bool = True
    # Address to listen on: a loopback address, unless scrapers must
    # authenticate over HTTPS (tls_cert with client_ca or token_file).
    host: str = "127.0.0.1"
    # TCP port; 0 = any free port (logged, and shown by `hicached status`).
    port: int = 9395
    # Server certificate and key (PEM files) for HTTPS; both or neither.
    tls_cert: str = ""
    tls_key: str = ""
    # CA bundle (PEM) that scrapers' client certificates must chain to; with it,
    # HTTPS requires a client certificate.
    client_ca: str = ""
    # File holding the bearer token every scrape must send (Authorization:
    # Bearer TOKEN; Prometheus: authorization.credentials_file). It must be the
    # daemon's user's and open to no one else (mode 0600 or 0400), and the token
    # at least 16 visible ASCII characters. Read at start and again at each
    # reload (SIGHUP). "" = no token: with [tenants] and no client_ca every
    # scrape is then refused, since the metrics name every tenant.
    token_file: str = ""
    # Seconds a scrape waits for the daemon's snapshot before it fails; an hour at most.
    scrape_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be 0-65535")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.client_ca and not self.tls_cert:
            raise ValueError("client_ca needs tls_cert and tls_key")
        if self.token_file and not self.token_file.startswith("/"):
            raise ValueError("token_file must be an absolute path")
        try:
            loopback = self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            raise ValueError(f"host {self.host!r}: give an IP address or localhost") from None
        if not loopback and not (self.tls_cert and (self.client_ca or self.token_file)):
            raise ValueError(
                f"host {self.host!r}: metrics are served off loopback only over HTTPS "
                "to scrapers that authenticate (set tls_cert and tls_key, and client_ca "
                "or token_file)"
            )
        # a wait past what the platform's clock holds (1e300) failed every scrape (500)
        if not 0 < self.scrape_timeout_s <= 3600:
            raise ValueError("scrape_timeout_s must be positive, an hour at most")

    @property
    def authenticated(self) -> bool:
        """Every scrape proves who it is: a token, a client certificate, or both."""
        return bool(self.token_file or self.client_ca)
