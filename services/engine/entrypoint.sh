#!/bin/sh
# The engine image's entrypoint: the zero-config first start (model, token), then the command (`serve`).
#
# KEEPWARM_MODEL unset (or empty, as compose.yaml passes it when the host has none): serve the demo
# model at /models/demo-dense, making it there first when the folder is missing (the `models`
# volume keeps it for later starts). A set KEEPWARM_MODEL is used as is: a missing folder is the
# engine's error, never replaced by the demo model.
set -eu
if [ -z "${KEEPWARM_MODEL:-}" ]; then
  KEEPWARM_MODEL=/models/demo-dense
  export KEEPWARM_MODEL
  if [ ! -e "$KEEPWARM_MODEL" ]; then
    echo "keepwarm: KEEPWARM_MODEL is unset and $KEEPWARM_MODEL is missing: making the demo model there" \
      "(first start; set KEEPWARM_MODEL=/models/<folder> to serve your own checkpoint)" >&2
    python -m keepwarm.engine.demo.demo_model --family dense "$KEEPWARM_MODEL" >&2
    echo "keepwarm: made the demo model in $KEEPWARM_MODEL" >&2
  fi
fi
# The bearer token the gateway must send: KEEPWARM_ENGINE_TOKEN when set, else one made once into
# KEEPWARM_ENGINE_TOKEN_FILE (compose.yaml: the volume `engine-token`, which the gateway reads).
if [ -z "${KEEPWARM_ENGINE_TOKEN:-}" ] && [ -n "${KEEPWARM_ENGINE_TOKEN_FILE:-}" ]; then
  if [ ! -s "$KEEPWARM_ENGINE_TOKEN_FILE" ]; then
    python -c 'import secrets; print(secrets.token_hex(32))' > "$KEEPWARM_ENGINE_TOKEN_FILE.tmp"
    chmod 0644 "$KEEPWARM_ENGINE_TOKEN_FILE.tmp" # the gateway reads it as another user
    mv "$KEEPWARM_ENGINE_TOKEN_FILE.tmp" "$KEEPWARM_ENGINE_TOKEN_FILE"
    echo "keepwarm: made the engine token in $KEEPWARM_ENGINE_TOKEN_FILE" >&2
  fi
  KEEPWARM_ENGINE_TOKEN="$(cat "$KEEPWARM_ENGINE_TOKEN_FILE")"
  export KEEPWARM_ENGINE_TOKEN
fi
exec "$@"
