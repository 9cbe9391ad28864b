#!/bin/sh
# summary.sh: the median and range of every benchmark metric over repeated
# runs (go test -count N), from go test's output on standard input:
#
#   go test -run '^$' -bench '^BenchmarkPeers$' -benchtime 5x -count 3 ./driver | sh test/bench/summary.sh
#
# prints, per benchmark and metric, "median [min – max] (runs)".
awk '
$1 ~ /^Benchmark/ && NF >= 4 {
	name = $1
	sub(/-[0-9]+$/, "", name)
	if (!(name in seen)) { seen[name] = 1; order[++nb] = name }
	for (i = 3; i + 1 <= NF; i += 2) {
		key = name SUBSEP $(i + 1)
		if (!(key in cnt)) { units[name] = units[name] " " $(i + 1) }
		vals[key, ++cnt[key]] = $i
	}
}
END {
	for (b = 1; b <= nb; b++) {
		name = order[b]
		print name
		nu = split(substr(units[name], 2), us, " ")
		for (u = 1; u <= nu; u++) {
			key = name SUBSEP us[u]
			n = cnt[key]
			for (i = 1; i <= n; i++) v[i] = vals[key, i] + 0
			for (i = 2; i <= n; i++)            # insertion sort: n is small
				for (j = i; j > 1 && v[j - 1] > v[j]; j--) { t = v[j]; v[j] = v[j - 1]; v[j - 1] = t }
			med = (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
			printf "  %-22s %12.4g  [%.4g – %.4g]  (%d)\n", us[u], med, v[1], v[n], n
		}
	}
}'
