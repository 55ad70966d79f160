"""python -m keepwarm.api --engine http://127.0.0.1:8100 [--engine ...] --redis-url redis://... --port 8000

Every flag also reads its KEEPWARM_* variable (see keepwarm.api.config)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

import uvicorn

from keepwarm.api.app import create_app
from keepwarm.api.bootstrap import first_start
from keepwarm.api.config import ConfigError, parse_config


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv, first_start(os.environ))
    except ConfigError as e:
        print(f"keepwarm.api: {e}", file=sys.stderr)
        return 2
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level="info",
        timeout_graceful_shutdown=5,
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
