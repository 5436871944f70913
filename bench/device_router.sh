#!/usr/bin/env bash
# `tessera bench router` on a machine with more cores than this one (the lent device machine): at 100
# concurrent streams on a 2-core machine the client, the workers and the router share two cores, so the
# router's CPU comes out of the others' share and the ratio measures the machine, not the router.
#
# The device machine has no virtual environment and no network, and what travels with the working tree
# is limited to 64 MiB, so `bundle` packs this machine's Python 3.11 (standard library and the shared
# libraries its modules link) and the site-packages that the router, the sim-engine workers and the
# bench import (not torch or vLLM) into two archives under build/devsite/. `run` unpacks them there
# and runs the bench; its JSON goes to $OUT.
#
#   bench/device_router.sh bundle                       # here
#   run(command="bench/device_router.sh run", carry=["build/devsite/py.tar.xz",
#       "build/devsite/site.tar.xz"])                   # on the device machine
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=$ROOT/build/devsite
# What the bench's three kinds of process import from site-packages (listed from sys.modules of each).
PACKAGES="annotated_doc annotated_types anyio certifi click email_validator fastapi h11 httpcore httptools
httpx idna msgspec numpy numpy.libs orjson prometheus_client pulp pydantic pydantic_core pydantic_extra_types
pygments python_multipart rich sniffio starlette typing_extensions.py typing_inspection uvicorn uvloop
watchfiles websockets yaml _yaml markdown_it mdurl zmq pyzmq.libs zstandard"
SYSTEM_LIBS="libssl.so.3 libcrypto.so.3 libffi.so.8 libz.so.1 liblzma.so.5 libbz2.so.1.0 libuuid.so.1"

bundle() {
  local prefix site work
  prefix=$(python3.11 -c 'import sys; print(sys.base_prefix)' 2>/dev/null || "$ROOT/.venv/bin/python" -c 'import sys; print(sys.base_prefix)')
  site=$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  work=$(mktemp -d)
  mkdir -p "$work/py/bin" "$work/py/lib/python3.11/site-packages" "$work/site" "$DEST"
  cp "$prefix/bin/python3.11" "$work/py/bin/"
  cp "$prefix/lib/libpython3.11.so.1.0" "$work/py/lib/"
  for lib in $SYSTEM_LIBS; do cp -L "/lib/x86_64-linux-gnu/$lib" "$work/py/lib/"; done
  (cd "$prefix/lib" && tar cf - --exclude=__pycache__ --exclude=python3.11/test --exclude=python3.11/site-packages \
    --exclude='python3.11/config-3.11*' --exclude=python3.11/idlelib --exclude=python3.11/tkinter \
    --exclude=python3.11/ensurepip --exclude=python3.11/lib2to3 python3.11) | (cd "$work/py/lib" && tar xf -)
  for pkg in $PACKAGES; do [ -e "$site/$pkg" ] && cp -r "$site/$pkg" "$work/site/"; done
  cp -r "$site"/*.dist-info "$work/site/"
  rm -rf "$work/site/pulp/solverdir"
  find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
  # The editable install maps tessera.worker, .operator and .sim to top-level folders; so does this.
  cat > "$work/site/sitecustomize.py" <<'EOF'
import os
import sys

sys.path.insert(0, os.environ["TESSERA_ROOT"])
import tessera  # noqa: E402

tessera.__path__.append(os.environ["TESSERA_ROOT"])
EOF
  tar cJf "$DEST/py.tar.xz" -C "$work" py
  tar cJf "$DEST/site.tar.xz" -C "$work" site
  rm -rf "$work"
  ls -la "$DEST"/*.tar.xz
}

run() {
  local unpacked=/tmp/tessera-devsite py
  mkdir -p "$unpacked"
  tar xJf "$DEST/py.tar.xz" -C "$unpacked"
  tar xJf "$DEST/site.tar.xz" -C "$unpacked"
  export LD_LIBRARY_PATH=$unpacked/py/lib PYTHONHOME=$unpacked/py PYTHONPATH=$unpacked/site TESSERA_ROOT=$ROOT
  py=$unpacked/py/bin/python3.11
  echo "cores: $(nproc)"
  cd "$ROOT"
  "$py" -m tessera bench router --set streams=100,300 --set rounds=10 --set faults=false --json "$OUT/router-100-300.json"
  "$py" -m tessera bench router --set streams=1000 --set rounds=3 --set faults=false --json "$OUT/router-1000.json"
}

case "${1:-}" in
  bundle) bundle ;;
  run) run ;;
  *) echo "usage: $0 bundle|run (see the comment at the top)" >&2; exit 2 ;;
esac
