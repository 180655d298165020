# Sourced by the one-call device scripts: $out (= $OUT, or ./out), unbuffered Python, and the wheels that
# scripts/device-prep.sh carries in .whl/ installed into $site (put it on PYTHONPATH after the tree).
out="${OUT:-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
site=/tmp/site
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site .whl/*.whl
fi
