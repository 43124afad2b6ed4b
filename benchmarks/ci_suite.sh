#!/usr/bin/env bash
# The clean-clone suite time the README states, with its raw record: clones HEAD into a
# temporary folder, runs `.ci/run` there (a fresh virtual environment, the style, import and
# docs checks, then the README's test command) under `/usr/bin/time -v`, unchanged except that
# pytest also lists its 40 slowest test phases (`--durations=40` through PYTEST_ADDOPTS); the
# record keeps that list, pytest's summary line and the wall and CPU time of the whole.
#
#   bash benchmarks/ci_suite.sh            # writes benchmarks/results/ci_suite/<commit>.txt
#
# The record names the machine (CPU model, cores, memory), the commit, the UTC start and end,
# and the load average before and after (a figure from a loaded machine is not the suite's).
# Run it on an idle machine: about 15 minutes on 2 cores. The status is `.ci/run`'s.
set -u
cd "$(dirname "$0")/.."
commit=$(git rev-parse --short HEAD)
out=benchmarks/results/ci_suite/$commit.txt
mkdir -p "$(dirname "$out")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git clone -q . "$tmp/clone"
{
  echo "commit: $(git rev-parse HEAD)"
  echo "dirty (of the checkout the clone came from; the clone is HEAD): $(git status --porcelain | wc -l) paths"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
  echo "memory: $(free -g | awk '/^Mem:/ {print $2}') GiB"
  echo "start (UTC): $(date -u '+%Y-%m-%d %H:%M:%S')"
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$out"
# --durations=40: pytest lists the 40 slowest test phases at the end of its output.
(cd "$tmp/clone" && PYTEST_ADDOPTS="--durations=40" /usr/bin/time -v .ci/run) >"$tmp/log" 2>&1
status=$?
{
  echo "end (UTC): $(date -u '+%Y-%m-%d %H:%M:%S')"
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo ".ci/run exit status: $status"
  echo
  echo "--- pytest's slowest phases and summary (raw) ---"
  sed -n '/slowest .* durations/,/=\{5,\} .* in [0-9.]*s/p' "$tmp/log"
  echo
  if [ "$status" -ne 0 ]; then
    echo "--- the last 60 lines of .ci/run's output (it failed) ---"
    tail -n 60 "$tmp/log"
    echo
  fi
  echo "--- /usr/bin/time -v of .ci/run (raw) ---"
  grep -E 'Elapsed \(wall clock\)|User time|System time|Maximum resident' "$tmp/log"
} >>"$out"
echo "wrote $out (status $status)"
exit $status
