"""Gateway process configuration: one frozen dataclass, filled from CLI flags
or environment variables, passed down explicitly.

Environment (a flag overrides its variable):
  KEEPWARM_ENGINES          comma-separated engine base URLs      (--engine, repeatable);
                            dns+http://NAME:PORT stands for every address NAME resolves to
  KEEPWARM_REDIS_URL / REDIS_URL                                  (--redis-url)
  KEEPWARM_API_KEYS         "key1:tenantA,key2:tenantB"           (--api-keys)
  KEEPWARM_API_KEYS_FILE    one "key tenant" per line, # comments (--api-keys-file)
  KEEPWARM_SECRET           server secret the tenant salts derive from (--secret)
  KEEPWARM_HOST, KEEPWARM_GATEWAY_PORT (or --port)
  KEEPWARM_RATE_LIMIT       requests per tenant per window, 0 = off (--rate-limit)
  KEEPWARM_RATE_WINDOW      window seconds                          (--rate-window)
  KEEPWARM_MAX_BODY_BYTES   largest accepted request body           (--max-body-bytes)
  KEEPWARM_SESSION_TTL      seconds a session is remembered         (--session-ttl)
  KEEPWARM_HEALTH_INTERVAL  seconds between engine health polls     (--health-interval)
  KEEPWARM_HEALTH_TIMEOUT   seconds one engine health probe may take  (--health-timeout)
  KEEPWARM_READ_TIMEOUT     seconds an engine may stay silent before the request
                            moves to another engine (streams get keep-alives)   (--read-timeout)
  KEEPWARM_ADMIN_TENANTS    tenants allowed to DELETE /v1/cache and list every tenant's
                            cache entries; empty (the default) = no tenant   (--admin-tenants)
  KEEPWARM_ENGINE_TOKEN / KEEPWARM_ENGINE_TOKEN_FILE
                            the engines' shared token, sent as `Authorization: Bearer`
                            (environment or file only: never a command-line argument)
  KEEPWARM_MAX_MESSAGES     most `messages` one chat request may carry  (--max-messages)
  KEEPWARM_REDIS_TIMEOUT    seconds one Redis call may take            (--redis-timeout)
  KEEPWARM_REDIS_COOLDOWN   seconds between pings while Redis is down  (--redis-cooldown)

Tenant names are 1-64 of [A-Za-z0-9_.-]: they are part of Redis keys, so no
name may contain the ':' that separates a tenant from a session id.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from keepwarm.api.engines import EngineSourceError, parse_engine

TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class ConfigError(ValueError):
    """Bad gateway configuration; the message names the flag/variable and what to change."""


@dataclass(frozen=True)
class GatewayConfig:
    engines: tuple[str, ...]  # engine base URLs, no trailing slash
    redis_url: str
    api_keys: Mapping[str, str]  # API key -> tenant
    secret: bytes  # HMAC key for tenant salts; never leaves the gateway
    host: str = "127.0.0.1"
    port: int = 8000
    rate_limit: int = 0  # requests per tenant per window; 0 = unlimited
    rate_window_s: int = 60
    max_body_bytes: int = 1024 * 1024
    session_ttl_s: int = 7 * 24 * 3600
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0  # one /health probe; 3 in a row time out = down
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0  # engines send SSE keep-alives during long prefills
    timeline_len: int = 100  # per-session request records kept
    recent_len: int = 200  # global recent request records kept for /v1/stats
    ttft_len: int = 500  # recent TTFT values kept per class (cold / warm)
    redis_prefix: str = "keepwarm:"
    admin_tenants: tuple[str, ...] = ()  # who may clear / list the whole cache; () = nobody
    engine_token: str = field(default="", repr=False)  # "" = engines run without one
    max_messages: int = 1024
    redis_timeout_s: float = 0.5  # per Redis call (socket), no retries: the breaker decides
    redis_cooldown_s: float = 5.0

    def validate(self) -> GatewayConfig:
        if not self.engines:
            raise ConfigError("no engine configured: pass --engine http://HOST:PORT or set KEEPWARM_ENGINES")
        for url in self.engines:
            try:
                parse_engine(url)
            except EngineSourceError as e:
                raise ConfigError(str(e)) from None
        if len(set(self.engines)) != len(self.engines):
            raise ConfigError(f"engine URLs must be distinct, got {list(self.engines)}")
        if not self.api_keys:
            raise ConfigError(
                "no API keys: set KEEPWARM_API_KEYS='key:tenant,...' or KEEPWARM_API_KEYS_FILE (one 'key tenant' a line)"
            )
        if len(self.secret) < 16:
            raise ConfigError("KEEPWARM_SECRET (--secret) must be set, at least 16 characters")
        if self.rate_limit < 0 or self.rate_window_s <= 0:
            raise ConfigError("--rate-limit must be >= 0 and --rate-window > 0")
        if self.max_body_bytes <= 0 or self.session_ttl_s <= 0 or self.health_interval_s <= 0:
            raise ConfigError("--max-body-bytes, --session-ttl and --health-interval must be positive")
        for name in (
            "health_timeout_s",
            "read_timeout_s",
            "redis_timeout_s",
            "redis_cooldown_s",
            "max_messages",
        ):
            if getattr(self, name) <= 0:
                flag = name.removesuffix("_s").replace("_", "-")
                raise ConfigError(f"--{flag} (KEEPWARM_{flag.replace('-', '_').upper()}) must be positive")
        for tenant in {*self.api_keys.values(), *self.admin_tenants}:
            if not TENANT_NAME.fullmatch(tenant):
                raise ConfigError(f"tenant name {tenant!r}: use 1-64 of the characters A-Z a-z 0-9 _ . -")
        if self.engine_token and len(self.engine_token) < 16:
            raise ConfigError("KEEPWARM_ENGINE_TOKEN must be at least 16 characters (or unset)")
        return self


def parse_api_keys(text: str) -> dict[str, str]:
    """'key1:tenantA,key2:tenantB' -> {key1: tenantA, key2: tenantB}."""
    keys: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, tenant = item.rpartition(":")
        if not sep or not key.strip() or not tenant.strip():
            raise ConfigError(f"KEEPWARM_API_KEYS item {item!r} must be 'key:tenant'")
        keys[key.strip()] = tenant.strip()
    return keys


def read_api_keys_file(path: Path) -> dict[str, str]:
    """One 'key tenant' per line; blank lines and '#' comments are skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read KEEPWARM_API_KEYS_FILE {str(path)!r}: {e.strerror}") from None
    keys: dict[str, str] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{path}:{n}: expected 'key tenant', got {raw!r}")
        keys[parts[0]] = parts[1]
    return keys


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", action="append", default=None, help="engine base URL (repeatable)")
    p.add_argument("--redis-url", default=None)
    p.add_argument("--api-keys", default=None, help="'key1:tenantA,key2:tenantB'")
    p.add_argument("--api-keys-file", default=None, type=Path)
    p.add_argument("--secret", default=None)
    p.add_argument("--host", default=None)
    p.add_argument("--port", default=None, type=int)
    p.add_argument("--rate-limit", default=None, type=int)
    p.add_argument("--rate-window", default=None, type=int)
    p.add_argument("--max-body-bytes", default=None, type=int)
    p.add_argument("--session-ttl", default=None, type=int)
    p.add_argument("--health-interval", default=None, type=float)
    p.add_argument("--health-timeout", default=None, type=float)
    p.add_argument("--read-timeout", default=None, type=float)
    p.add_argument(
        "--admin-tenants", default=None, help="'tenantA,tenantB': who may DELETE /v1/cache (default: nobody)"
    )
    p.add_argument("--max-messages", default=None, type=int)
    p.add_argument("--redis-timeout", default=None, type=float)
    p.add_argument("--redis-cooldown", default=None, type=float)


def config_from(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """Flags first, then KEEPWARM_* variables, then defaults."""
    env = os.environ if env is None else env

    def pick(flag: object, *names: str) -> str | None:
        if flag is not None:
            return str(flag)
        for name in names:
            if env.get(name):
                return env[name]
        return None

    def number(flag: object, name: str, default: float, kind: type) -> float:
        text = pick(flag, name)
        if text is None:
            return default
        try:
            return kind(text)
        except ValueError:
            raise ConfigError(f"{name} must be a {kind.__name__}, got {text!r}") from None

    engines: list[str] = list(args.engine or [])
    if not engines and env.get("KEEPWARM_ENGINES"):
        engines = [u for u in env["KEEPWARM_ENGINES"].split(",") if u.strip()]
    keys: dict[str, str] = {}
    keys_file = args.api_keys_file or (
        Path(env["KEEPWARM_API_KEYS_FILE"]) if env.get("KEEPWARM_API_KEYS_FILE") else None
    )
    if keys_file is not None:
        keys.update(read_api_keys_file(keys_file))
    keys_text = pick(args.api_keys, "KEEPWARM_API_KEYS")
    if keys_text:
        keys.update(parse_api_keys(keys_text))
    token = env.get("KEEPWARM_ENGINE_TOKEN") or ""
    if not token and env.get("KEEPWARM_ENGINE_TOKEN_FILE"):
        path = Path(env["KEEPWARM_ENGINE_TOKEN_FILE"])
        try:
            token = path.read_text().strip()
        except OSError as e:
            raise ConfigError(f"cannot read KEEPWARM_ENGINE_TOKEN_FILE {str(path)!r}: {e.strerror}") from None
    return GatewayConfig(
        engines=tuple(u.strip().rstrip("/") for u in engines),
        redis_url=pick(args.redis_url, "KEEPWARM_REDIS_URL", "REDIS_URL") or "redis://127.0.0.1:6379/0",
        api_keys=keys,
        secret=(pick(args.secret, "KEEPWARM_SECRET") or "").encode(),
        host=pick(args.host, "KEEPWARM_HOST") or "127.0.0.1",
        port=int(number(args.port, "KEEPWARM_GATEWAY_PORT", 8000, int)),
        rate_limit=int(number(args.rate_limit, "KEEPWARM_RATE_LIMIT", 0, int)),
        rate_window_s=int(number(args.rate_window, "KEEPWARM_RATE_WINDOW", 60, int)),
        max_body_bytes=int(number(args.max_body_bytes, "KEEPWARM_MAX_BODY_BYTES", 1024 * 1024, int)),
        session_ttl_s=int(number(args.session_ttl, "KEEPWARM_SESSION_TTL", 7 * 24 * 3600, int)),
        health_interval_s=number(args.health_interval, "KEEPWARM_HEALTH_INTERVAL", 2.0, float),
        health_timeout_s=number(args.health_timeout, "KEEPWARM_HEALTH_TIMEOUT", 2.0, float),
        read_timeout_s=number(args.read_timeout, "KEEPWARM_READ_TIMEOUT", 600.0, float),
        admin_tenants=tuple(
            t.strip()
            for t in (pick(args.admin_tenants, "KEEPWARM_ADMIN_TENANTS") or "").split(",")
            if t.strip()
        ),
        engine_token=token,
        max_messages=int(number(args.max_messages, "KEEPWARM_MAX_MESSAGES", 1024, int)),
        redis_timeout_s=number(args.redis_timeout, "KEEPWARM_REDIS_TIMEOUT", 0.5, float),
        redis_cooldown_s=number(args.redis_cooldown, "KEEPWARM_REDIS_COOLDOWN", 5.0, float),
    ).validate()


def parse_config(argv: Sequence[str], env: Mapping[str, str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m keepwarm.api")
    add_gateway_args(p)
    return config_from(p.parse_args(list(argv)), env)
