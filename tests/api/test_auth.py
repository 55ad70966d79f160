from __future__ import annotations

import hashlib
import hmac

import pytest

from keepwarm.api.auth import Authenticator, tenant_salt
from keepwarm.api.errors import ApiError

SECRET = b"server-secret-for-tests"


def test_salt_is_hmac_sha256_of_tenant() -> None:
    assert tenant_salt(SECRET, "alpha") == hmac.new(SECRET, b"alpha", hashlib.sha256).hexdigest()
    assert tenant_salt(SECRET, "alpha") != tenant_salt(SECRET, "beta")
    assert tenant_salt(SECRET, "alpha") != tenant_salt(b"another-secret", "alpha")


def test_bearer_key_maps_to_tenant_and_salt() -> None:
    auth = Authenticator({"k1": "alpha", "k2": "beta", "k3": "alpha"}, SECRET)
    c = auth.authenticate("Bearer k2")
    assert (c.tenant, c.salt) == ("beta", tenant_salt(SECRET, "beta"))
    # Two keys of one tenant share the tenant's salt, so they share its cache.
    assert auth.authenticate("bearer  k1").salt == auth.authenticate("Bearer k3").salt


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "missing API key"),
        ("", "missing API key"),
        ("Basic k1", "malformed Authorization header"),
        ("Bearer", "malformed Authorization header"),
        ("Bearer nope", "invalid API key"),
    ],
)
def test_bad_credentials_are_401(header: str | None, message: str) -> None:
    auth = Authenticator({"k1": "alpha"}, SECRET)
    with pytest.raises(ApiError) as err:
        auth.authenticate(header)
    assert err.value.status == 401
    assert message in err.value.message
    assert err.value.body()["error"]["type"] == "authentication_error"
