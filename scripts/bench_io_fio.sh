#!/usr/bin/env bash
# Strata's I/O engine against fio, interleaved in one run.
#
#   scripts/bench_io_fio.sh DIR [size=1GiB] [block=1MiB] [qd=32]
#
# For each repetition (REPS, default 3) and each engine pair (Strata uring vs
# fio io_uring, Strata aio vs fio libaio) it runs a sequential O_DIRECT write
# then read of a `size` file in DIR with the same block size and queue depth,
# fio batched as fairly as it goes (--iodepth_batch_submit=QD
# --iodepth_batch_complete_min=1), alternating which tool goes first. It
# prints the median GB/s of each and the Strata/fio ratio per backend and
# direction. Disks drift (these virtio ones by up to 2x within an hour), so
# only ratios from one interleaved run mean anything.
#
# fio's io_uring runs twice: as is, and with --fixedbufs --registerfiles
# (registered buffers and file, as Strata uses): the second is the stronger
# ceiling on machines where per-request page pinning costs (virtio here).
#
# Environment: STRATA_BIN (the strata binary; default: the newest
# build*/tools/strata in the repository, else `strata` on PATH), REPS,
# FIO_EXTRA (extra fio arguments for every fio run), FIO_URING_EXTRA (for
# the io_uring runs only).
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
  exit 1
fi
DIR=$1
SIZE=${2:-1GiB}
BLOCK=${3:-1MiB}
QD=${4:-32}
REPS=${REPS:-3}
FIO_EXTRA=${FIO_EXTRA:-}
FIO_URING_EXTRA=${FIO_URING_EXTRA:-}

die() { echo "bench_io_fio.sh: $*" >&2; exit 1; }
[[ -d "$DIR" ]] || die "$DIR is not a directory"
command -v fio >/dev/null || die "fio is not installed (apt-get install fio)"
command -v python3 >/dev/null || die "python3 is needed to read the JSON results"

here=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z "${STRATA_BIN:-}" ]]; then
  STRATA_BIN=$(ls -t "$here"/build*/tools/strata 2>/dev/null | head -1 || true)
  [[ -n "$STRATA_BIN" ]] || STRATA_BIN=$(command -v strata || true)
fi
[[ -x "${STRATA_BIN:-}" ]] || die "no strata binary: build it or set STRATA_BIN"

# Sizes in bytes for fio (which reads "1M" as MiB but "1MB" differently by
# version): one parser, Python's, for both tools' arguments.
to_bytes() {
  python3 - "$1" <<'EOF'
import re, sys
m = re.fullmatch(r'\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b?)\s*', sys.argv[1], re.I)
if not m: sys.exit(f"cannot read size {sys.argv[1]!r}")
n, u, _ = m.groups()
v = float(n) * 1024 ** "bkmgt".index((u or "b").lower())
print(int(v))
EOF
}
SIZE_B=$(to_bytes "$SIZE") || exit 1
BLOCK_B=$(to_bytes "$BLOCK") || exit 1
[[ $QD =~ ^[0-9]+$ ]] && (( QD >= 1 && QD <= 4096 )) || die "queue depth $QD is not an integer in 1..4096"
[[ $REPS =~ ^[0-9]+$ ]] && (( REPS >= 1 )) || die "REPS=$REPS is not a positive integer"
(( SIZE_B > 0 )) || die "size $SIZE is 0 bytes"
(( BLOCK_B > 0 && BLOCK_B % 4096 == 0 )) || die "block $BLOCK is not a positive multiple of 4 KiB (O_DIRECT)"
(( SIZE_B % BLOCK_B == 0 )) || die "size $SIZE is not a multiple of block $BLOCK"

out=$(mktemp -d)
fio_file="$DIR/strata-fio-bench.$$.dat"
trap 'rm -rf "$out" "$fio_file"' EXIT

drop_caches() { sync; [[ -w /proc/sys/vm/drop_caches ]] && echo 3 > /proc/sys/vm/drop_caches || true; }

run_fio() {  # engine rw rep [tag extra-args]: results in fio.<tag or engine>.<rw>.<rep>.json
  local engine=$1 rw=$2 rep=$3 tag=${4:-$1} extra="$FIO_EXTRA ${5:-}"
  [[ $engine == io_uring ]] && extra="$extra $FIO_URING_EXTRA"
  drop_caches
  # shellcheck disable=SC2086
  fio --name=strata-cmp --filename="$fio_file" --size="$SIZE_B" --bs="$BLOCK_B" --iodepth="$QD" \
    --ioengine="$engine" --direct=1 --rw="$rw" --iodepth_batch_submit="$QD" --iodepth_batch_complete_min=1 \
    --numjobs=1 --thread --output-format=json $extra > "$out/fio.$tag.$rw.$rep.json"
}

# fio's io_uring at its best also registers its buffers and file, as Strata
# does; both fio variants are reported.
run_fio_pair() {  # strata-backend fio-engine rep
  run_fio "$2" write "$3"; run_fio "$2" read "$3"
  if [[ $2 == io_uring ]]; then
    rm -f "$fio_file"  # every write goes to a fresh file, as Strata's does
    run_fio io_uring write "$3" io_uring_fixed "--fixedbufs --registerfiles"
    run_fio io_uring read "$3" io_uring_fixed "--fixedbufs --registerfiles"
  fi
  rm -f "$fio_file"
}

run_strata() {  # backend rep
  drop_caches
  "$STRATA_BIN" bench io --dir "$DIR" --size "$SIZE_B" --block "$BLOCK_B" --qd "$QD" --backend "$1" --json \
    > "$out/strata.$1.$2.json"
}

echo "strata $("$STRATA_BIN" --version | head -1 | cut -d' ' -f2) vs $(fio --version); $SIZE file, $BLOCK blocks, qd $QD, $REPS reps, in $DIR"
for rep in $(seq 1 "$REPS"); do
  for pair in "uring io_uring" "aio libaio"; do
    set -- $pair
    if (( rep % 2 )); then
      run_fio_pair "$1" "$2" "$rep"; run_strata "$1" "$rep"
    else
      run_strata "$1" "$rep"; run_fio_pair "$1" "$2" "$rep"
    fi
    echo "  rep $rep/$REPS: $1 done" >&2
  done
done

python3 - "$out" "$REPS" <<'EOF'
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
targets = {"uring": 0.95, "aio": 0.90}
rows = [("uring", "io_uring", "fio io_uring"), ("uring", "io_uring_fixed", "fio io_uring --fixedbufs --registerfiles"),
        ("aio", "libaio", "fio libaio")]
print(f"{'strata':7} {'op':6} {'strata GB/s':>12} {'fio GB/s':>10} {'ratio':>7} {'target':>7}       against / runs (strata | fio)")
for b, tag, label in rows:
    for op in ("write", "read"):
        s, f = [], []
        for r in range(1, reps + 1):
            try:
                j = json.load(open(f"{out}/strata.{b}.{r}.json"))
                s += [x["gbps"] for x in j["results"] if x["backend"] == b and x["op"] == op]
                fj = json.load(open(f"{out}/fio.{tag}.{op}.{r}.json"))
                f.append(fj["jobs"][0][op]["bw_bytes"] / 1e9)
            except (OSError, KeyError, IndexError, ValueError):
                pass
        if not s or not f:
            print(f"{b:7} {op:6} {'n/a':>12} {'n/a':>10}  {label}")
            continue
        ms, mf = statistics.median(s), statistics.median(f)
        ratio = ms / mf if mf else float("nan")
        mark = "ok" if ratio >= targets[b] else "BELOW"
        runs = " ".join(f"{x:.2f}" for x in s) + " | " + " ".join(f"{x:.2f}" for x in f)
        print(f"{b:7} {op:6} {ms:12.3f} {mf:10.3f} {ratio:7.2f} {'>=' + str(targets[b]):>7} {mark:5} {label} / {runs}")
EOF
