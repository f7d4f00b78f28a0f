#!/usr/bin/env bash
# Sets up, builds and runs the main job: `strata demo`, a small fine-tune with
# its parameters and optimizer states on NVMe, in a temporary directory under
# $TMPDIR (default /var/tmp, which is on disk where /tmp may be tmpfs). It
# prints the loss as it falls, the validation loss before and after, tokens/s
# and the wall time, then removes the directory (also on Ctrl-C).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
export BUILD_DIR
bash "$ROOT/scripts/setup.sh"
bash "$ROOT/scripts/build.sh"
"$BUILD_DIR/tools/strata" --version
exec "$BUILD_DIR/tools/strata" demo --dir "${TMPDIR:-/var/tmp}" "$@"
