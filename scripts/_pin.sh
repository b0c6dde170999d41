# Sourced by the bash scripts: read sglang.pin (root=$1) the way scripts/_series.py does,
# with a one-line error for a missing or malformed file instead of bash's own.
_pin="$1/sglang.pin"
[ -f "$_pin" ] || { echo "error: $_pin is missing: it pins the SGLang release the series is for" >&2; exit 1; }
_n=0
unset SGLANG_VERSION SGLANG_COMMIT
while IFS= read -r _line || [ -n "$_line" ]; do
  _n=$((_n + 1))
  [[ "$_line" =~ ^[[:space:]]*(#.*)?$ ]] && continue
  [[ "$_line" =~ ^[A-Z_]+=[^[:space:]\"\']+$ ]] \
    || { echo "error: $_pin:$_n: expected KEY=value without quotes or spaces" >&2; exit 1; }
  printf -v "${_line%%=*}" "%s" "${_line#*=}"
done < "$_pin"
for _key in SGLANG_VERSION SGLANG_COMMIT; do
  [ -n "${!_key:-}" ] || { echo "error: $_pin does not set $_key" >&2; exit 1; }
done
unset _pin _n _line _key
