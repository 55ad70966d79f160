"""API keys -> tenant, and the tenant's cache salt.

The salt namespaces a tenant's prefix-cache keys on the engines, so one tenant
can never hit (or probe for) another tenant's prompts. It is derived here from
a server secret and the tenant name and never taken from a client.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from keepwarm.api.errors import ApiError


@dataclass(frozen=True)
class Caller:
    tenant: str
    salt: str  # HMAC-SHA256(secret, tenant) hex


def tenant_salt(secret: bytes, tenant: str) -> str:
    return hmac.new(secret, tenant.encode(), hashlib.sha256).hexdigest()


class Authenticator:
    def __init__(self, api_keys: Mapping[str, str], secret: bytes) -> None:
        assert api_keys, "an Authenticator needs at least one key"
        # Keys are compared as their SHA-256 digests with compare_digest over all
        # of them, so neither a lookup's timing nor its early exit leaks a key.
        self._keys = [(hashlib.sha256(k.encode()).digest(), t) for k, t in api_keys.items()]
        self._secret = secret

    def tenant_of(self, key: str) -> str | None:
        digest = hashlib.sha256(key.encode()).digest()
        found: str | None = None
        for known, tenant in self._keys:
            if hmac.compare_digest(known, digest):
                found = tenant
        return found

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller for an `Authorization` header value; raises a 401 ApiError."""
        if not authorization:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "malformed Authorization header: use 'Authorization: Bearer <key>'")
        tenant = self.tenant_of(key.strip())
        if tenant is None:
            raise ApiError(401, "invalid API key: check the key in 'Authorization: Bearer <key>'")
        return Caller(tenant=tenant, salt=tenant_salt(self._secret, tenant))
