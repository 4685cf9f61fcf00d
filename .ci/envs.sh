# CI's environments, kept outside the clone and keyed by what determines them: the Python that builds them, the torch
# pin, the extras, pyproject.toml, pip's constraints and settings (and, for the peers, deepspeed's wheel). A hit
# installs only this clone's project (`--no-deps -e .`); the newest-release environment also upgrades every
# dependency eagerly on a hit. Sourced by .ci/run.

DEEPSPEED=deepspeed==0.19.8
CI_CACHE="${LIT_FSDP_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lit_fsdp/ci}"
CI_LOGS="${TMPDIR:-/tmp}/lit_fsdp-ci-$$"
mkdir -p "$CI_CACHE" "$CI_LOGS"

timed() {  # NAME COMMAND...: run it (stopping at its first failing command), then print its seconds and the total
  local name=$1 begin=$SECONDS status
  shift
  echo ".ci/run: $name ..."
  set +e  # not `"$@" || ...`: bash ignores errexit inside a command that is the left side of ||
  ( set -e; "$@" )
  status=$?
  set -e
  echo ".ci/run: $name: $((SECONDS - begin)) s (total ${SECONDS} s)$([ "$status" -eq 0 ] || echo ", exit $status")"
  return "$status"
}

python312() {  # python3.12, or pyenv's 3.12 where python3.12 is a shim of another version
  local python
  for python in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if "$python" -c "" 2>/dev/null; then echo "$python"; return; fi
  done
  echo ".ci/run: the newest-release run needs Python 3.12 (numpy 2.5 and later require it); install one" >&2
  return 1
}

cpu_flags() { grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-12 || true; }

peers_wheels() {  # where deepspeed's wheel with its ops built for this CPU is kept (where earlier runs built it)
  echo "${XDG_CACHE_HOME:-$HOME/.cache}/lit_fsdp/${DEEPSPEED/==/-}-torch-2.13.0-$(python3 -c \
    'import sys; print("py%d%d" % sys.version_info[:2])')-cpu-$(cpu_flags)"
}

peers_wheel() { ls "$(peers_wheels)"/deepspeed-*.whl 2>/dev/null; }

env_key() {  # PYTHON TORCH EXTRAS: a hash of everything that determines the environment
  {
    "$1" -c 'import sys; print(sys.version)'
    echo "$2 [$3]"
    cat pyproject.toml
    cat /etc/xdg/pip/* /etc/pip.conf "${PIP_CONFIG_FILE:-/dev/null}" 2>/dev/null || true
    env | grep '^PIP_' | grep -v '^PIP_\(NO_\)\?CACHE_DIR=' | sort || true  # pip's cache makes no difference
    case $3 in *peers*) basename "$(peers_wheel)" ;; esac
  } | sha256sum | cut -c1-16
}

env_dir() {  # NAME PYTHON TORCH EXTRAS: the environment's folder
  echo "$CI_CACHE/venv-$1-$(env_key "$2" "$3" "$4")"
}

ensure_env() {  # NAME PYTHON TORCH EXTRAS [eager]: build the environment on a miss; on a hit install this clone
  local name=$1 python=$2 torch=$3 extras=$4 eager=${5:-} dir
  dir=$(env_dir "$name" "$python" "$torch" "$extras")
  local pip=("$dir/bin/python" -m pip install -q)
  if [ -f "$dir/.complete" ]; then
    echo ".ci/run: $name environment cached: $dir"
    if [ -n "$eager" ]; then
      "${pip[@]}" -e ".[$extras]" --upgrade --upgrade-strategy eager
    else
      "${pip[@]}" --no-deps -e .
    fi
  else
    echo ".ci/run: $name environment built from nothing: $dir"
    rm -rf "$dir"
    "$python" -m venv "$dir"
    "${pip[@]}" --upgrade pip
    "${pip[@]}" "$torch"  # the pin first: a plain `torch` requirement could pull another build
    case $extras in *peers*) "${pip[@]}" "ninja>=1.11" "py-cpuinfo>=9" "$(peers_wheel)" ;; esac
    "${pip[@]}" -e ".[$extras]" ${eager:+--upgrade --upgrade-strategy eager}
    touch "$dir/.complete"
  fi
  touch "$dir"  # its last use, for prune_envs
  prune_envs "$name" "$dir"
}

prune_envs() {  # NAME KEEP: remove this name's environments but the two most recently used (5 GB each)
  local old
  for old in $(ls -dt "$CI_CACHE"/venv-"$1"-* 2>/dev/null | tail -n +3); do
    [ "$old" = "$2" ] || rm -rf "$old"
  done
}

background_env() {  # NAME PYTHON TORCH EXTRAS [eager]: ensure_env in the background, its output kept for finish_env
  ( begin=$SECONDS
    set +e
    ( set -e; ensure_env "$@" ) > "$CI_LOGS/$1.log" 2>&1
    echo "$? $((SECONDS - begin))" > "$CI_LOGS/$1.done" ) &
}

finish_env() {  # NAME ...: wait for background_env NAME; its output, and how long it took while the suite ran
  local status seconds
  while [ ! -f "$CI_LOGS/$1.done" ]; do sleep 2; done
  cat "$CI_LOGS/$1.log"
  read -r status seconds < "$CI_LOGS/$1.done"
  echo ".ci/run: $1 environment: $seconds s in the background, beside the main suite$([ "$status" -eq 0 ] || echo ", exit $status")"
  return "$status"
}

build_peers_wheel() {  # deepspeed with its CPU Adam and shared-memory collectives built for this CPU, once
  peers_wheel >/dev/null && return 0
  local build="$CI_CACHE/deepspeed-build"
  rm -rf "$build"
  python3 -m venv "$build"
  "$build/bin/python" -m pip install -q --upgrade pip
  "$build/bin/python" -m pip install -q torch==2.13.0 "ninja>=1.11" "py-cpuinfo>=9" setuptools wheel
  DS_ACCELERATOR=cpu DS_BUILD_OPS=0 DS_BUILD_CPU_ADAM=1 DS_BUILD_SHM_COMM=1 \
    "$build/bin/python" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$(peers_wheels)" "$DEEPSPEED"
  rm -rf "$build"
}
