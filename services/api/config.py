"""Gateway process configuration: one frozen dataclass, filled from flags, KEEPWARM_* variables
and defaults by keepwarm.settings (`python -m keepwarm.api --help` lists them), passed down
explicitly.

Tenant names are 1-64 of [A-Za-z0-9_.-]: they are part of Redis keys, so no name may contain
the ':' that separates a tenant from a session id.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from keepwarm.api.engines import EngineSourceError, parse_engine
from keepwarm.settings import SettingsError, add_arguments, internal, load, parse_list, setting, size_setting

TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

ConfigError = SettingsError  # bad gateway configuration; the message names the flag/variable


def parse_api_keys(text: str) -> dict[str, str]:
    """'key1:tenantA,key2:tenantB' -> {key1: tenantA, key2: tenantB}. A key may contain ':';
    the tenant is after the last one."""
    keys: dict[str, str] = {}
    for n, item in enumerate(text.split(","), 1):
        key, sep, tenant = item.strip().rpartition(":")
        if not item.strip():
            continue
        if not sep or not key.strip() or not tenant.strip():
            raise ValueError(f"item {n} must be 'key:tenant' (items separated by commas)")
        keys[key.strip()] = tenant.strip()
    return keys


def parse_api_keys_file(text: str) -> dict[str, str]:
    """One 'key tenant' per line; blank lines and '#' comments are skipped."""
    keys: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        parts = raw.split("#", 1)[0].split()
        if not parts:
            continue
        if len(parts) != 2:
            raise ValueError(f"line {n}: expected 'key tenant', got {len(parts)} words")
        keys[parts[0]] = parts[1]
    return keys


def _engine_urls(text: str) -> tuple[str, ...]:
    return tuple(u.rstrip("/") for u in parse_list(text))


@dataclass(frozen=True)
class GatewayConfig:
    engines: tuple[str, ...] = setting(
        (),
        flag="--engine",
        env=("KEEPWARM_ENGINES",),
        parse=_engine_urls,
        repeat=True,
        metavar="URL",
        default_text="(required)",
        help="engine base URL; repeat the flag, or separate URLs by commas in the variable; "
        "`dns+http://NAME:PORT` is every address NAME resolves to (see Scaling out)",
    )
    redis_url: str = setting(
        "redis://127.0.0.1:6379/0",
        env=("KEEPWARM_REDIS_URL", "REDIS_URL"),
        help="Redis (Valkey) for sessions, stats and rate limits",
    )
    api_keys: Mapping[str, str] = setting(
        default_factory=dict,
        env=("KEEPWARM_API_KEYS",),
        parse=parse_api_keys,
        secret=True,
        file_flag="--api-keys-file",
        parse_file=parse_api_keys_file,
        merge=lambda from_file, inline: {**from_file, **inline},
        default_text="(required)",
        help="the clients' keys: `key1:tenantA,key2:tenantB`, or a file of `key tenant` lines "
        "(# comments); both given: all of them",
    )
    secret: bytes = setting(
        b"",
        env=("KEEPWARM_SECRET",),
        secret=True,
        file_env=(),
        default_text="(required)",
        help="server secret (at least 16 characters) the tenant cache salts derive from; keep it stable",
    )
    host: str = setting("127.0.0.1", env=("KEEPWARM_HOST",), help="listen address")
    port: int = setting(8000, env=("KEEPWARM_GATEWAY_PORT",), help="listen port")
    rate_limit: int = setting(
        0, env=("KEEPWARM_RATE_LIMIT",), help="requests per tenant per window (429 beyond); 0 = unlimited"
    )
    rate_window_s: int = setting(
        60, flag="--rate-window", env=("KEEPWARM_RATE_WINDOW",), help="rate limit window, seconds"
    )
    max_body_bytes: int = size_setting(
        1024 * 1024,
        env=("KEEPWARM_MAX_BODY_BYTES",),
        help="largest accepted request body, bytes (`1m`, `1048576`; 413 beyond)",
    )
    session_ttl_s: int = setting(
        7 * 24 * 3600,
        flag="--session-ttl",
        env=("KEEPWARM_SESSION_TTL",),
        help="seconds a session is remembered",
    )
    health_interval_s: float = setting(
        2.0,
        flag="--health-interval",
        env=("KEEPWARM_HEALTH_INTERVAL",),
        help="seconds between engine health polls",
    )
    health_timeout_s: float = setting(
        2.0,
        flag="--health-timeout",
        env=("KEEPWARM_HEALTH_TIMEOUT",),
        help="seconds one engine health probe may take; 3 in a row timed out = engine down",
    )
    connect_timeout_s: float = internal(2.0)
    read_timeout_s: float = setting(
        600.0,
        flag="--read-timeout",
        env=("KEEPWARM_READ_TIMEOUT",),
        help="seconds an engine may stay silent before the request moves to another engine "
        "(engines send SSE keep-alives during long prefills)",
    )
    timeline_len: int = internal(100)  # per-session request records kept
    recent_len: int = internal(200)  # global recent request records kept for /v1/stats
    ttft_len: int = internal(500)  # recent TTFT values kept per class (cold / warm)
    redis_prefix: str = internal("keepwarm:")
    admin_tenants: tuple[str, ...] = setting(
        (),
        env=("KEEPWARM_ADMIN_TENANTS",),
        default_text="(none)",
        help="tenants (`tenantA,tenantB`) that may DELETE /v1/cache and list every tenant's cache "
        "entries; none by default",
    )
    engine_token: str = setting(
        "",
        flag=None,
        env=("KEEPWARM_ENGINE_TOKEN",),
        secret=True,
        default_text="(unset: engines without a token)",
        help="the engines' shared token (at least 16 characters), sent as `Authorization: Bearer`; "
        "the engines then answer nobody else but /health",
    )
    max_messages: int = setting(
        1024, env=("KEEPWARM_MAX_MESSAGES",), help="most `messages` one chat request may carry"
    )
    redis_timeout_s: float = setting(
        0.5,
        flag="--redis-timeout",
        env=("KEEPWARM_REDIS_TIMEOUT",),
        help="seconds one Redis call may take (no retries: the circuit breaker decides)",
    )
    redis_cooldown_s: float = setting(
        0.5,
        flag="--redis-cooldown",
        env=("KEEPWARM_REDIS_COOLDOWN",),
        help="seconds between probes while Redis is down (one at a time, on fresh connections); chats "
        "skip Redis meanwhile and still answer, and use it again at the first probe it answers",
    )

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


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    add_arguments(p, GatewayConfig)


def config_from(args: argparse.Namespace | None, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """Flags first, then KEEPWARM_* variables, then defaults."""
    return load(GatewayConfig, args, env).validate()


def parse_config(argv: Sequence[str], env: Mapping[str, str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m keepwarm.api", description="keepwarm gateway")
    add_gateway_args(p)
    return config_from(p.parse_args(list(argv)), env)
