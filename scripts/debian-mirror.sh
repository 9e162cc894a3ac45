# Sourced by scripts that run mmdebstrap: sets $mirror (unless already set) to the first Debian
# URI of this machine's apt sources, else http://deb.debian.org/debian, and $security beside it.
if [ -z "${mirror:-}" ]; then
  mirror=$(sed -n 's/^URIs:[[:space:]]*\(http[^ ]*\/debian\)[[:space:]]*$/\1/p' \
             /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1 || true)
  if [ -z "$mirror" ] && [ -f /etc/apt/sources.list ]; then
    mirror=$(awk '$1 == "deb" && $2 ~ /\/debian\/?$/ { print $2; exit }' /etc/apt/sources.list)
  fi
  mirror=${mirror:-http://deb.debian.org/debian}
fi
security=${mirror%/debian}/debian-security
