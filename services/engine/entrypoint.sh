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
  # Replicas started together (`--scale engine=N`) take turns: the first makes the model, the
  # others wait on the lock and then find it.
  exec 9>"$(dirname "$KEEPWARM_MODEL")/.demo-model.lock"
  flock 9
  if [ ! -e "$KEEPWARM_MODEL" ]; then
    echo "keepwarm: KEEPWARM_MODEL is unset and $KEEPWARM_MODEL is missing: making the demo model there" \
      "(first start; set KEEPWARM_MODEL=/models/<folder> to serve your own checkpoint)" >&2
    python -m keepwarm.engine.demo.demo_model --family dense "$KEEPWARM_MODEL" >&2
    echo "keepwarm: made the demo model in $KEEPWARM_MODEL" >&2
  fi
  flock -u 9
  exec 9>&-
fi
# The bearer token the gateway must send: KEEPWARM_ENGINE_TOKEN when set, else one made once into
# KEEPWARM_ENGINE_TOKEN_FILE (compose.yaml: the volume `engine-token`, which the gateway reads).
if [ -z "${KEEPWARM_ENGINE_TOKEN:-}" ] && [ -n "${KEEPWARM_ENGINE_TOKEN_FILE:-}" ]; then
  if [ ! -s "$KEEPWARM_ENGINE_TOKEN_FILE" ]; then
    # A unique temp file linked into place: with several replicas starting at once the first
    # link wins and every replica then reads that one token.
    tmp="$(mktemp "$KEEPWARM_ENGINE_TOKEN_FILE.XXXXXX")"
    python -c 'import secrets; print(secrets.token_hex(32))' > "$tmp"
    chmod 0644 "$tmp" # the gateway reads it as another user
    if ln "$tmp" "$KEEPWARM_ENGINE_TOKEN_FILE" 2>/dev/null; then
      echo "keepwarm: made the engine token in $KEEPWARM_ENGINE_TOKEN_FILE" >&2
    fi
    rm -f "$tmp"
  fi
  KEEPWARM_ENGINE_TOKEN="$(cat "$KEEPWARM_ENGINE_TOKEN_FILE")"
  export KEEPWARM_ENGINE_TOKEN
fi
exec "$@"
