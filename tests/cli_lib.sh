# Shared helpers for the command-line tests (sourced, not run):
#   source "$(dirname "$0")/../cli_lib.sh"
#   cli_command "$strata" bench adam        # what expect_error runs
#   cli_clean_dir "$dir"                    # optional: expect_error checks it stays empty
#   expect_error "text the message must contain" args...
#   fail "what went wrong"
#   cli_finish "name of the checks"         # exit 1 on failures, 0 otherwise
# Exit status convention: 0 pass, 1 fail, 77 skip (ctest SKIP_RETURN_CODE).

failures=0
cli_cmd=()
cli_dir=""
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
cli_command() { cli_cmd=("$@"); }
cli_clean_dir() { cli_dir=$1; }

# A bad input must exit with status 1 (not a crash, not a signal) and say
# what is wrong; with cli_clean_dir set, it must also leave nothing behind.
expect_error() {
  local want=$1
  shift
  local out rc
  out=$(timeout 60 "${cli_cmd[@]}" "$@" 2>&1)
  rc=$?
  local what="${cli_cmd[*]:1} $*"
  if [[ $rc -ne 1 ]]; then fail "$what exited $rc, not 1: $out"; return; fi
  [[ $out == *"$want"* ]] || fail "$what: message lacks '$want': $out"
  if [[ -n $cli_dir && -n $(ls -A "$cli_dir") ]]; then
    fail "$what left files: $(ls -A "$cli_dir")"
    rm -rf "${cli_dir:?}"/*
  fi
}

cli_finish() {
  if ((failures)); then
    echo "$failures failure(s)"
    exit 1
  fi
  echo "all $1 checks passed"
  exit 0
}
