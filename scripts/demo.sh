#!/usr/bin/env bash
# Sets up, builds and runs the main job. Until `strata demo` exists this is a
# short I/O benchmark on a temporary directory and a CPU AdamW benchmark, each
# next to a ceiling measured in the same run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
export BUILD_DIR
bash "$ROOT/scripts/setup.sh"
bash "$ROOT/scripts/build.sh"
"$BUILD_DIR/tools/strata" --version
DIR="$(mktemp -d "${TMPDIR:-/var/tmp}/strata-demo.XXXXXX")"
trap 'rm -rf "$DIR"' EXIT
"$BUILD_DIR/tools/strata" bench io --dir "$DIR" --size 512MiB --block 1MiB --qd 32 --backend all
"$BUILD_DIR/tools/strata" bench adam --params 32M --iters 5
