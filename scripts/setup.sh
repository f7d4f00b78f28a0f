#!/usr/bin/env bash
# Installs the Debian packages Strata builds against. Idempotent and
# non-interactive: packages already present are not touched, apt-get update
# runs only when something is missing.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config git
  liburing-dev libaio-dev libtbb-dev libeigen3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev
  fio clang libclang-rt-14-dev
  python3-venv ccache
  libopenmpi-dev openmpi-bin iproute2
)
# Open MPI: the communicator's mpi-labelled tests (mpirun -np 2/3) and, later,
# host ranks; a build without it (STRATA_MPI=OFF) still works. iproute2 (`ip`):
# the multi-host test's network namespaces (engine_mpi_netns).
# python3-venv: the Python package's test installs it into a fresh virtual
# environment (ctest python_package); ccache speeds that build up when it repeats.
# clang with libclang-rt-14-dev (libFuzzer's runtime: only recommended by clang,
# and this script installs without recommends) builds the fuzz targets.
# Optional extras (CI sets STRATA_SETUP_EXTRAS=1):
#  - g++-aarch64-linux-gnu + qemu-user: the NEON optimizer kernel is not only
#    compiled but run against the scalar one under qemu;
#  - xfsprogs: the checkpoint reflink test makes an XFS loop image.
if [[ "${STRATA_SETUP_EXTRAS:-0}" == "1" ]]; then PKGS+=(g++-aarch64-linux-gnu qemu-user xfsprogs); fi

# The reference tests' Python packages (STRATA_SETUP_REFERENCE=1; CI sets
# it): torch, transformers, tokenizers, safetensors and peft from PyPI, pinned, so
# the tests against the real thing run instead of skipping. torch is a
# multi-GB download (its CUDA libraries): pip's cache keeps it between runs.
REFERENCE_PY=(torch==2.15.0 transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 peft==0.21.2 accelerate==1.15.0
             deepspeed==0.19.8)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  echo "setup: installing ${missing[*]}"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all packages present"
fi

if [[ "${STRATA_SETUP_REFERENCE:-0}" == "1" ]]; then
  PY="${STRATA_TEST_PYTHON:-python3}"
  if "$PY" -c 'import torch, transformers, tokenizers, safetensors, peft, accelerate, deepspeed' >/dev/null 2>&1; then
    echo "setup: reference Python packages present ($PY)"
  else
    echo "setup: installing ${REFERENCE_PY[*]} for $PY"
    "$PY" -m pip install -q --disable-pip-version-check "${REFERENCE_PY[@]}"
  fi
fi
