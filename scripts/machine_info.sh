#!/usr/bin/env bash
# One line describing where a benchmark ran, for BENCHMARKS.md.
cpu=$(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2; exit}')
isa=$(grep -o -w -E 'avx512f|avx2|fma|f16c|avx512_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')
mem=$(free -g | awk '/Mem:/ {print $2 " GiB"}')
disk=$(df -h "${1:-/tmp}" | awk 'NR==2 {print $1}')
echo "date $(date -u +%F) | commit $(git -C "$(dirname "$0")/.." rev-parse --short HEAD) | $(nproc) cores $cpu ($isa) | $mem | kernel $(uname -r) | disk $disk"
