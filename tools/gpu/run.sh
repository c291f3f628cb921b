#!/usr/bin/env bash
# On the GPU machine, from the repository root (see docs/testing.md, "GPU harness"):
#   tools/gpu/run.sh receive VERSION        keep the chunk(s) this call carried
#   tools/gpu/run.sh install VERSION        install the release (once) under /tmp/gpu-site
#   tools/gpu/run.sh suite VERSION [ARGS]   install the release (once), run the suite
#   tools/gpu/run.sh python VERSION ARGS    install the release (once), run python3 ARGS
#   tools/gpu/run.sh site-path VERSION      the installed release's import path
#   tools/gpu/run.sh detach VERSION [ARGS]  as suite, but in its own process session
#   tools/gpu/run.sh collect VERSION [WAIT] wait up to WAIT s for it; hand back its files
#   tools/gpu/run.sh prebuild VERSION MODEL build a suite model (tiny-v4-e128) in the
#                                           background while chunks still travel
# A detached suite outlives the call that starts it (it runs until the machine goes
# back), so its engines keep their compiled kernels past one call's 10 minutes; later
# calls collect it, each waiting inside its own limit.
# A call carries one chunk of .cache/gpu-stage/VERSION (made by tools/gpu/stage.py);
# a suite call may carry .cache/gpu-kernels-packed (the kernel cache handed back);
# /tmp lasts while the machine stays warm, so the chunks gather there call by call.
set -euo pipefail
command=$1 version=$2
shift 2
staged=.cache/gpu-stage/$version
held=/tmp/gpu-stage/$version
site=${GPU_SITE_ROOT:-/tmp/gpu-site}/$version

receive() {
  mkdir -p "$held"
  cp "$staged"/manifest.json "$held"/
  for chunk in "$staged"/chunk-*; do
    if [ -f "$chunk" ]; then cp "$chunk" "$held"/; fi
  done
  echo "held for $version: $(cd "$held" && ls chunk-* | tr '\n' ' ')"
}

install() {
  [ -f "$site/.complete" ] && return
  python3 - "$held" <<'PY'
import hashlib, json, sys
from pathlib import Path
held = Path(sys.argv[1])
manifest = json.loads((held / "manifest.json").read_text())
missing = [c for c in manifest["chunks"] if not (held / c).exists()]
if missing:
    sys.exit(f"chunks not carried yet: {' '.join(missing)}")
digest = hashlib.sha256()
with open(held / "wheels.tar", "wb") as out:
    for chunk in manifest["chunks"]:
        data = (held / chunk).read_bytes()
        digest.update(data)
        out.write(data)
if digest.hexdigest() != manifest["tar_sha256"]:
    sys.exit("the joined chunks do not match the manifest's sha256")
PY
  tar xf "$held"/wheels.tar -C "$held"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" "$held"/wheels/*.whl
  touch "$site/.complete"
}

# the kernel cache a session carried packed (tools/gpu/suite.py hands it back so),
# unpacked once per machine: later calls of a hold keep the folder they have grown
unpack_kernels() {
  local packed=.cache/gpu-kernels-packed
  [ -d .cache/gpu-kernels ] && return
  compgen -G "$packed/kernel-cache.tar.gz*" >/dev/null || return 0
  cat "$packed"/kernel-cache.tar.gz* | tar xzf - -C .cache
  echo "kernel cache unpacked: $(du -sh .cache/gpu-kernels | cut -f1)"
}

# the release's folder, and the folders its wheels' .pth files add: only a real site
# directory reads .pth files, and pip --target is not one. Python's own site module
# reads them here, as a site directory would: the CUTLASS DSL's names its package
# folder as a line (dsl_packages in 4.4, python_packages in 4.5) or adds it from an
# import line (4.6)
site_path() {
  python3 - "$site" <<'PY'
import os, site, sys
folder = sys.argv[1]
before = set(sys.path)
site.addsitedir(folder)
added = [path for path in sys.path if path not in before and path != folder]
print(os.pathsep.join([folder, *added]))
PY
}

detached=/tmp/gpu-detached/$version

detach() {
  if [ -f "$detached/pid" ] && kill -0 "$(cat "$detached/pid")" 2>/dev/null; then
    echo "a detached suite is already running for $version"; return
  fi
  rm -rf "$detached" && mkdir -p "$detached"
  local path
  path=$(site_path)
  VLLM_GPU_SITE=$path PYTHONPATH=$path PYTHONUNBUFFERED=1 \
    setsid python3 tools/gpu/suite.py "$detached/out" "$@" >"$detached/log" 2>&1 </dev/null &
  echo $! >"$detached/pid"
  echo "detached suite for $version: pid $(cat "$detached/pid"), log $detached/log"
}

collect() {
  local wait=${1:-0} waited=0
  [ -f "$detached/pid" ] || { echo "no detached suite for $version" >&2; exit 1; }
  while kill -0 "$(cat "$detached/pid")" 2>/dev/null && [ "$waited" -lt "$wait" ]; do
    sleep 5
    waited=$((waited + 5))
  done
  if kill -0 "$(cat "$detached/pid")" 2>/dev/null; then
    echo "still running after ${waited}s; the log's end:"
    tail -n 40 "$detached/log"
    return
  fi
  cat "$detached/log"
  cp "$detached"/out/* "${OUT:-/tmp/gpu-out}"/ 2>/dev/null || true
  cp "$detached/log" "${OUT:-/tmp/gpu-out}"/suite-$version.log
}

# the suite's models lock is taken inside the build, so a suite detached later waits
# for it: no wait loop in the calling shell (pgrep -f matches that shell's own line)
prebuild() {
  local model=$1 logs=/tmp/gpu-prebuild
  mkdir -p "$logs"
  setsid python3 -c 'import sys; sys.path.insert(0, "tools/gpu"); import suite; suite.prebuild(sys.argv[1])' \
    "$model" >"$logs/$model.log" 2>&1 </dev/null &
  echo "building $model in the background: log $logs/$model.log"
}

# what every command that runs the release needs first
prepare() {
  receive
  install
  unpack_kernels
}

# run "$@" with the installed release importable
with_site() {
  local path
  path=$(site_path)
  VLLM_GPU_SITE=$path PYTHONPATH=$path "$@"
}

case $command in
  receive) receive ;;
  install)
    receive
    install
    ;;
  suite)
    prepare
    with_site python3 tools/gpu/suite.py "${OUT:-/tmp/gpu-out}" "$@"
    ;;
  detach)
    prepare
    detach "$@"
    ;;
  collect) collect "$@" ;;
  prebuild) prebuild "$@" ;;
  site-path) site_path ;;
  python)
    prepare
    with_site python3 "$@"
    ;;
  *) echo "usage: tools/gpu/run.sh receive|install|suite|detach|collect|prebuild|python|site-path VERSION [args]" >&2; exit 2 ;;
esac
