"""Who may call, and the accounting of every call: shared by the gRPC service and the data plane.

Both ways into the server — gRPC calls (:mod:`kvtier.server.service`) and
data-plane requests (:mod:`kvtier.server.dataplane_session`) — pass the same
:class:`Gate`: the same tenants and roles (bearer token → tenant), the same
refusals, the same put byte budget, the same metrics (``method`` tells them
apart: ``Get`` vs ``data.Get``), and one count of calls in flight, so a
graceful stop waits for both.
"""

from __future__ import annotations

import threading
import time

import grpc

from kvtier.server.admission import (
    ByteBudget,
    RequestError,
    denied,
    over_limit,
    unauthenticated,
)
from kvtier.server.metrics import ServerMetrics
from kvtier.server.tenants import Tenant, TenantDirectory, UnknownTokenError
from kvtier.server_config import Role, ServerConfig


class Gate:
    """Authentication, authorization, draining and per-call accounting of one server.

    Args:
        directory: Tokens → tenants.
        config: The in-flight put budget.
        metrics: Where calls, refusals and the budget are counted.

    Thread-safe.
    """

    def __init__(
        self, directory: TenantDirectory, config: ServerConfig, metrics: ServerMetrics
    ) -> None:
        self.directory = directory
        self.metrics = metrics
        self.put_budget = ByteBudget(config.max_inflight_put_bytes)
        """Bytes of half-received blocks, every Put stream and data-plane PUT together."""
        metrics.inflight_put_bytes.set_function(lambda: float(self.put_budget.used))
        self._tenant_put_bytes = config.effective_tenant_put_bytes
        self._tenant_budgets: dict[str, ByteBudget] = {}
        self._max_calls = config.effective_tenant_max_calls
        self._calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._draining = False
        self._inflight = 0
        self._idle = threading.Condition()

    # -- who ---------------------------------------------------------------------

    def authenticate(self, token: str | None) -> Tenant | None:
        """The tenant of ``token`` (``None``: no token on a closed server).

        Raises:
            RequestError: UNAUTHENTICATED for a token that matches no tenant.
        """
        try:
            return self.directory.by_token(token)
        except UnknownTokenError as e:
            raise unauthenticated(str(e)) from None

    @staticmethod
    def authorize(tenant: Tenant | None, role: Role | None, how: str = "a token") -> None:
        """Check that ``tenant`` may make a call that needs ``role`` (``None``: anyone).

        Args:
            tenant: The caller.
            role: What the call needs.
            how: How a caller sends a token, for the refusal's message.

        Raises:
            RequestError: UNAUTHENTICATED without a tenant, PERMISSION_DENIED
                for a role below ``role``.
        """
        if role is None:
            return
        if tenant is None:
            raise unauthenticated(f"this server needs a token: send {how}")
        if not tenant.may(role):
            raise denied(f"tenant {tenant.name!r} has role {tenant.role}; this call needs {role}")

    # -- per tenant -------------------------------------------------------------

    def tenant_budget(self, tenant: Tenant) -> ByteBudget:
        """The bytes ``tenant`` may be receiving at once (within :attr:`put_budget`)."""
        with self._lock:
            budget = self._tenant_budgets.get(tenant.name)
            if budget is None:
                budget = self._tenant_budgets[tenant.name] = ByteBudget(self._tenant_put_bytes)
            return budget

    def admit(self, tenant: Tenant) -> None:
        """A gRPC call of ``tenant`` starts (pair with :meth:`release`).

        Raises:
            RequestError: RESOURCE_EXHAUSTED when the tenant already has
                ``tenant_max_calls`` calls in flight: one tenant never holds
                every thread of the pool.
        """
        with self._lock:
            n = self._calls.get(tenant.name, 0)
            if n >= self._max_calls:
                raise over_limit(
                    f"tenant {tenant.name!r} has {n} calls in flight, the most one tenant may "
                    "have; retry later"
                )
            self._calls[tenant.name] = n + 1

    def release(self, tenant: Tenant) -> None:
        """A call admitted by :meth:`admit` ended."""
        with self._lock:
            self._calls[tenant.name] -= 1

    # -- lifecycle ---------------------------------------------------------------

    def drain(self) -> None:
        """Refuse new calls from now on (UNAVAILABLE); calls in flight go on."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no call is being served; ``False`` on timeout."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    # -- accounting --------------------------------------------------------------

    def enter(self) -> None:
        """A call starts (pair with :meth:`leave`)."""
        with self._idle:
            self._inflight += 1
        self.metrics.inflight.inc()

    def leave(self, method: str, label: str, code: grpc.StatusCode, start: float) -> None:
        """A call that started at ``start`` (``perf_counter``) ended with ``code``."""
        self.metrics.requests.labels(label, method, code.name).inc()
        self.metrics.latency.labels(method).observe(time.perf_counter() - start)
        self.metrics.inflight.dec()
        with self._idle:
            self._inflight -= 1
            if not self._inflight:
                self._idle.notify_all()

    def refused(self, e: RequestError) -> None:
        """Count a refusal by its reason."""
        self.metrics.rejected.labels(e.reason).inc()
