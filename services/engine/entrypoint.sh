#!/bin/sh
# The engine image's entrypoint: the zero-config first start (model, token), then the command (`serve`).
#
# KEEPWARM_MODEL unset (or empty, as compose.yaml passes it when the host has none): serve
# SmolLM2-135M-Instruct, its GGUF file copied from the image's package into /models on the first
# start (the `models` volume keeps it). KEEPWARM_MODEL=demo: the random-weight demo model, made at
# /models/demo-dense. Any other KEEPWARM_MODEL is used as is: a missing model is the engine's error.
set -eu
if [ -z "${KEEPWARM_MODEL:-}" ] || [ "${KEEPWARM_MODEL}" = demo ]; then
  # Replicas started together (`--scale engine=N`) take turns: the first writes the model, the
  # others wait on the lock and then find it.
  mkdir -p /models
  exec 9>/models/.default-model.lock
  flock 9
  if [ -z "${KEEPWARM_MODEL:-}" ]; then
    KEEPWARM_MODEL="$(python -m keepwarm.engine.loading.packaged_model copy-into /models)"
    echo "keepwarm: KEEPWARM_MODEL is unset: serving SmolLM2-135M-Instruct from $KEEPWARM_MODEL" \
      "(set KEEPWARM_MODEL=/models/<folder or .gguf> to serve your own model)" >&2
  else
    KEEPWARM_MODEL=/models/demo-dense
    if [ ! -e "$KEEPWARM_MODEL" ]; then
      echo "keepwarm: making the demo model in $KEEPWARM_MODEL (first start)" >&2
      python -m keepwarm.engine.demo.demo_model --family dense "$KEEPWARM_MODEL" >&2
    fi
  fi
  export KEEPWARM_MODEL
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
