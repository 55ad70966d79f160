# Shared set-up for ops/* scripts: source it, then call ensure_venv / ensure_debian.
# Idempotent: a second run reuses the venv unless pyproject.toml changed.

KW_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KW_VENV="${KW_VENV:-$KW_ROOT/.venv}"
KW_PY="$KW_VENV/bin/python"
# The local CPU wheel; the ROCm image brings its own torch and never runs this.
KW_TORCH_SPEC="${KW_TORCH_SPEC:-torch==2.13.0}"

kw_log() { printf '[keepwarm] %s\n' "$*" >&2; }

ensure_venv() {
  local stamp="$KW_VENV/.keepwarm-stamp" want hash
  hash="$(sha256sum "$KW_ROOT/pyproject.toml" | cut -c1-16)"
  want="$hash ${1:-dev}"
  # the dev extra includes every other one
  if [ -x "$KW_PY" ] && [ -f "$stamp" ] && { [ "$(cat "$stamp")" = "$want" ] || [ "$(cat "$stamp")" = "$hash dev" ]; }; then
    return 0
  fi
  local py
  py="$(command -v python3.11 || command -v python3)"
  if [ ! -x "$KW_PY" ]; then
    kw_log "creating $KW_VENV with $py"
    "$py" -m venv "$KW_VENV"
    "$KW_PY" -m pip install -q --upgrade pip
  fi
  # torch first, pinned, so that no later resolution pulls a multi-GB CUDA build.
  if ! "$KW_PY" -c "import torch" 2>/dev/null; then
    kw_log "installing $KW_TORCH_SPEC"
    "$KW_PY" -m pip install -q "$KW_TORCH_SPEC"
  fi
  kw_log "installing keepwarm[${1:-dev}]"
  "$KW_PY" -m pip install -q -e "$KW_ROOT[${1:-dev}]"
  echo "$want" > "$stamp"
}

# ensure_debian BINARY PACKAGE: install PACKAGE with apt-get when BINARY is missing.
ensure_debian() {
  command -v "$1" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    kw_log "warning: $1 is missing; install the Debian package $2"
    return 0
  fi
  kw_log "installing Debian package $2"
  if [ -z "${KW_APT_UPDATED:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    KW_APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null
}

# ensure_demo_model [FAMILY]: prints the demo checkpoint folder, making it on first use.
ensure_demo_model() {
  local family="${1:-dense}" dir
  dir="${KEEPWARM_DEMO_DIR:-$KW_ROOT/models}/demo-$family"
  if [ ! -f "$dir/config.json" ]; then
    kw_log "making the $family demo model in $dir (first use)"
    "$KW_PY" -m keepwarm.engine.demo.demo_model --family "$family" "$dir" >&2
  fi
  echo "$dir"
}
