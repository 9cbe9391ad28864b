#!/bin/sh
# Assemble a managed (v2) plugin directory for `docker plugin create`:
#   OUT/config.json   (this directory's config.json)
#   OUT/rootfs/       (the static overlayd binary as /bin/overlayd, and the
#                      mount points the config uses)
# Usage: plugin/mkplugin.sh OUT OVERLAYD_BINARY
# Used by `make plugin` (OUT = plugin/build) and by the real-engine tests.
set -eu
[ $# -eq 2 ] || { echo "usage: $0 OUT OVERLAYD_BINARY" >&2; exit 2; }
out=$1
bin=$2
here=$(cd "$(dirname "$0")" && pwd)
[ -x "$bin" ] || { echo "$0: $bin: not an executable" >&2; exit 1; }
case "$out" in
	""|/) echo "$0: refusing OUT=$out" >&2; exit 1 ;;
esac
rm -rf "$out"
mkdir -p "$out/rootfs/bin" "$out/rootfs/etc" "$out/rootfs/dev" "$out/rootfs/proc" \
	"$out/rootfs/sys" "$out/rootfs/tmp" "$out/rootfs/run/docker/plugins" \
	"$out/rootfs/run/overlayd" "$out/rootfs/var/lib/overlayd"
chmod 1777 "$out/rootfs/tmp"
cp "$bin" "$out/rootfs/bin/overlayd"
chmod 0755 "$out/rootfs/bin/overlayd"
cp "$here/config.json" "$out/config.json"
echo "plugin directory: $out (docker plugin create overlayd:latest $out)"
