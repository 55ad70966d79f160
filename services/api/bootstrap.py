"""The gateway's first start without configuration: the server secret and one API key, made once
in a state folder (compose.yaml mounts the named volume `gateway-state` there) and read back on
every later start.

  KEEPWARM_STATE_DIR   the state folder; unset turns all of this off (ops/up keeps its own state)
    secret             the HMAC key tenant salts derive from, used when KEEPWARM_SECRET is unset
    api-keys           "key tenant" lines (the KEEPWARM_API_KEYS_FILE format), used when neither
                       KEEPWARM_API_KEYS nor KEEPWARM_API_KEYS_FILE is set
    api-key            the generated key alone, for the dashboard (KEEPWARM_UI_API_KEY_FILE)

Explicit variables win: a set KEEPWARM_SECRET is used as is and no secret file is made; set keys
replace the generated one. The key is logged once, when it is made;
`python -m keepwarm.api.bootstrap` (in compose: `docker compose exec api python -m
keepwarm.api.bootstrap`) prints it again.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path

from keepwarm.api.config import ConfigError

ENV_STATE_DIR = "KEEPWARM_STATE_DIR"
SECRET_FILE = "secret"
KEYS_FILE = "api-keys"
KEY_FILE = "api-key"
TENANT = "default"  # the generated key's tenant

log = logging.getLogger("keepwarm.api.bootstrap")


def _make_once(path: Path, text: str) -> bool:
    """Writes `text` to `path` unless it exists; True when this call made it. The file appears
    whole or not at all (temp file, fsync, link), and two starts racing keep the first one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def first_start(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with KEEPWARM_SECRET and KEEPWARM_API_KEYS_FILE filled from the state folder where
    they are unset (making the files on the first start); `env` unchanged without a state folder."""
    out = dict(env)
    state = env.get(ENV_STATE_DIR)
    if not state:
        return out
    folder = Path(state)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not env.get("KEEPWARM_SECRET"):
            secret = folder / SECRET_FILE
            if _make_once(secret, secrets.token_hex(32) + "\n"):
                log.info("made the server secret in %s (tenant cache salts derive from it)", secret)
            out["KEEPWARM_SECRET"] = secret.read_text().strip()
        if not env.get("KEEPWARM_API_KEYS") and not env.get("KEEPWARM_API_KEYS_FILE"):
            keys, key = folder / KEYS_FILE, folder / KEY_FILE
            if not keys.exists():
                new = "kw-" + secrets.token_urlsafe(24)
                _make_once(key, new + "\n")  # the dashboard's copy first: keys implies key
                if _make_once(keys, f"{key.read_text().strip()} {TENANT}\n"):
                    log.info(
                        "first start: made an API key for tenant %r; it is printed once here and again by "
                        "`python -m keepwarm.api.bootstrap`:\n\n    API key: %s\n",
                        TENANT,
                        key.read_text().strip(),
                    )
            out["KEEPWARM_API_KEYS_FILE"] = str(keys)
    except OSError as e:
        raise ConfigError(
            f"{ENV_STATE_DIR}={state!r}: cannot keep the gateway's state there ({e.strerror}); "
            "mount a writable volume there or set KEEPWARM_SECRET and KEEPWARM_API_KEYS"
        ) from None
    return out


def main() -> int:
    state = os.environ.get(ENV_STATE_DIR)
    if not state:
        print(f"{ENV_STATE_DIR} is not set: this gateway keeps no generated key", file=sys.stderr)
        return 2
    key = Path(state) / KEY_FILE
    if not key.is_file():
        print(
            f"no generated API key in {key}: the gateway has not started yet, or KEEPWARM_API_KEYS "
            "(or KEEPWARM_API_KEYS_FILE) was set, and then those are the keys",
            file=sys.stderr,
        )
        return 1
    print(key.read_text().strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
