#!/bin/sh
# Measures overlayd's driver and Docker's in-tree overlay driver side by side:
# the benchmarks of the same names (driver/bench_test.go, bench/intree), in
# ROUNDS interleaved rounds (the order alternates every round), on one
# machine in one run. Prints every round's figures and the in-tree/overlayd
# ratio, then per benchmark the median and range of the rounds.
#
#   sh bench/intree/compare.sh                   # 7 rounds of the Join and Leave benchmarks
#   ROUNDS=3 BENCH='Leave' BENCHTIME=30x sh bench/intree/compare.sh
#
# Needs root (both make network namespaces; the in-tree driver runs in its
# own anonymous namespaces, see intree_test.go).
set -eu
ROUNDS=${ROUNDS:-7}
BENCH=${BENCH:-'Join|Leave'}
BENCHTIME=${BENCHTIME:-30x}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

(cd "$root" && go test -c -o "$tmp/overlayd.test" ./driver)
(cd "$here" && go test -c -o "$tmp/intree.test" .)

run() { # run NAME: one round of one driver's benchmarks, as "name metric value" lines
	case $1 in
	overlayd) dir=$root/driver ;;
	intree) dir=$here ;;
	esac
	(cd "$dir" && "$tmp/$1.test" -test.run '^$' -test.bench "$BENCH" -test.benchtime "$BENCHTIME") |
		awk -v who="$1" '/^Benchmark/ { name=$1; sub(/-[0-9]+$/, "", name)
			for (i = 3; i < NF; i += 2) print who, name, $(i+1), $i }'
}

r=1
while [ "$r" -le "$ROUNDS" ]; do
	if [ $((r % 2)) -eq 1 ]; then order="overlayd intree"; else order="intree overlayd"; fi
	for who in $order; do
		run "$who" | sed "s/^/$r /" >>"$tmp/all"
	done
	echo "round $r done ($(cut -d' ' -f1-3 /proc/loadavg | tr ' ' '/') load)" >&2
	r=$((r + 1))
done

# round who name metric value → per round and benchmark: both figures and
# the ratio; then medians and ranges over the rounds.
awk '
{ v[$1 SUBSEP $2 SUBSEP $3 SUBSEP $4] = $5; names[$3 SUBSEP $4] = 1; if ($1 > R) R = $1 }
function fmtv(x, m) { return m ~ /ns\/op/ ? sprintf("%.2f ms", x / 1e6) : sprintf("%.4g", x) }
function med(a, n,   i, j, t) { for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j-1] > a[j]; j--) { t = a[j]; a[j] = a[j-1]; a[j-1] = t }
	return n % 2 ? a[(n+1)/2] : (a[n/2] + a[n/2+1]) / 2 }
END {
	n = 0; for (k in names) order[++n] = k
	for (i = 2; i <= n; i++) for (j = i; j > 1 && order[j-1] > order[j]; j--) { t = order[j]; order[j] = order[j-1]; order[j-1] = t }
	printf "%-22s %-12s %5s %14s %14s %8s\n", "benchmark", "metric", "round", "overlayd", "in-tree", "ratio"
	for (i = 1; i <= n; i++) {
		split(order[i], p, SUBSEP); c = 0
		for (r = 1; r <= R; r++) {
			o = v[r SUBSEP "overlayd" SUBSEP p[1] SUBSEP p[2]]; t = v[r SUBSEP "intree" SUBSEP p[1] SUBSEP p[2]]
			if (o == "" || t == "") continue
			c++; os[c] = o; ts[c] = t; rs[c] = t / o
			printf "%-22s %-12s %5d %14s %14s %7.2fx\n", p[1], p[2], r, fmtv(o, p[2]), fmtv(t, p[2]), t / o
		}
		if (c == 0) continue
		lo = rs[1]; hi = rs[1]; for (r = 1; r <= c; r++) { if (rs[r] < lo) lo = rs[r]; if (rs[r] > hi) hi = rs[r] }
		printf "%-22s %-12s %5s %14s %14s %7.2fx  (ratio range %.2f-%.2f)\n", p[1], p[2], "med", fmtv(med(os, c), p[2]), fmtv(med(ts, c), p[2]), med(rs, c), lo, hi
	}
}' "$tmp/all"
