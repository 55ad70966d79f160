"""Prefix-cache policies: `off`, `full`, `auto[:W]`, `N` (docs/architecture.md, 'Cache policies')."""

from __future__ import annotations

from dataclasses import dataclass

MAX_VALUE = 1_000_000
DEFAULT_WINDOW = 30
FORMS = "off, full, auto, auto:W or a token count N (W and N in 1..1000000)"


class PolicyError(ValueError):
    """An unparseable policy; the message lists the accepted forms."""


@dataclass(frozen=True)
class Policy:
    mode: str  # "off" | "full" | "auto" | "fixed"
    window: int = DEFAULT_WINDOW  # auto: how many recent prompts to compare with
    num_tokens: int = 0  # fixed: snapshot the first N tokens

    def __str__(self) -> str:
        if self.mode == "auto":
            return f"auto:{self.window}"
        if self.mode == "fixed":
            return str(self.num_tokens)
        return self.mode

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def _bounded(text: str, what: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise PolicyError(f"prefix cache {what} {text!r} is not a whole number; accepted: {FORMS}") from None
    if not 1 <= n <= MAX_VALUE:
        raise PolicyError(f"prefix cache {what} {n} is out of range; accepted: {FORMS}")
    return n


def parse_policy(text: str) -> Policy:
    s = str(text).strip().lower()
    if s in ("off", "none", "disabled"):
        return Policy("off")
    if s in ("full", "full-prefix"):
        return Policy("full")
    if s == "auto":
        return Policy("auto")
    if s.startswith("auto:"):
        return Policy("auto", window=_bounded(s[5:], "window"))
    if s.lstrip("-").isdigit():
        return Policy("fixed", num_tokens=_bounded(s, "token count"))
    raise PolicyError(f"unknown prefix cache scope {text!r}; accepted: {FORMS}")


def policy_for_request(default: Policy, scope: object = None, window: object = None) -> Policy:
    """The request's `prefix_cache: {scope, window}` applied over the server default."""
    policy = default if scope is None else parse_policy(str(scope))
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise PolicyError(f"prefix_cache.window must be an integer in 1..{MAX_VALUE}, got {window!r}")
        policy = Policy(policy.mode, window=_bounded(str(window), "window"), num_tokens=policy.num_tokens)
    return policy
