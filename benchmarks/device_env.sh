# Source on the device machine (bash), from the repository root, with .whl carried
# (benchmarks/fetch_wheels.sh): installs the wheels into /tmp/site once a machine, sets
# PYTHONPATH, and defines
#   ap NAME / rp NAME   apply / revert .whl/patches/NAME.patch (listed in /tmp/applied)
#   bt TAG ARGS...      benchmarks/bench_train.py ARGS, its log in $OUT/bt_TAG.log
# A warm machine keeps what an earlier call patched: the patches listed are reverted first.
if [ -f /tmp/applied ]; then
  tac /tmp/applied | while read -r p; do git apply -R ".whl/patches/$p.patch" && echo "reverted $p"; done
  rm -f /tmp/applied
fi
if [ ! -d /tmp/site/grain ]; then
  pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .whl/jla/*.whl 2>&1 | grep -v WARNING
  for m in wrapt attrs; do
    python -c "import $m" 2>/dev/null || pip install -q --no-index --no-deps --target /tmp/site .whl/extra/$m*.whl
  done
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
ap() { git apply ".whl/patches/$1.patch" && echo "$1" >> /tmp/applied && echo "applied $1"; }
rp() { git apply -R ".whl/patches/$1.patch" && sed -i "/^$1\$/d" /tmp/applied && echo "reverted $1"; }
bt() {
  local tag=$1; shift
  echo "== bt $tag $* (applied: $(tr '\n' ' ' < /tmp/applied 2>/dev/null))"
  timeout 400 python benchmarks/bench_train.py "$@" > "$OUT/bt_$tag.log" 2>&1
  tail -25 "$OUT/bt_$tag.log"
}
