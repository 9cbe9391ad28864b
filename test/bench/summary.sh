#!/bin/sh
# summary.sh: the median and range of every benchmark metric over repeated
# runs (go test -count N), from go test's output on standard input:
#
#   go test -run '^$' -bench '^BenchmarkPeers$' -benchtime 5x -count 3 ./driver | sh test/bench/summary.sh
#
# prints, per benchmark and metric, "median [min – max] (runs)". Then, for
# every benchmark whose name has an IPv6 counterpart (BenchmarkPeersIPv6/N
# beside BenchmarkPeers/N: the name with "IPv6" after its first word), the
# medians of their common metrics side by side with the IPv6 / IPv4 ratio
# (not peak-RSS-MB: a peak of the whole process, which ran both). The two
# run at different moments: on a shared machine compare their ratios to
# the raw-netlink reference (…ratio_to_raw), measured in the same rounds.
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
# median of the values of key (name SUBSEP unit); sets lo and hi.
function median(key,    n, i, j, t, v) {
	n = cnt[key]
	for (i = 1; i <= n; i++) v[i] = vals[key, i] + 0
	for (i = 2; i <= n; i++)            # insertion sort: n is small
		for (j = i; j > 1 && v[j - 1] > v[j]; j--) { t = v[j]; v[j] = v[j - 1]; v[j - 1] = t }
	lo = v[1]; hi = v[n]
	return (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
}
END {
	for (b = 1; b <= nb; b++) {
		name = order[b]
		print name
		nu = split(substr(units[name], 2), us, " ")
		for (u = 1; u <= nu; u++) {
			key = name SUBSEP us[u]
			med = median(key)
			printf "  %-22s %12.4g  [%.4g – %.4g]  (%d)\n", us[u], med, lo, hi, cnt[key]
		}
	}
	for (b = 1; b <= nb; b++) {
		v6 = order[b]
		if (v6 !~ /^Benchmark[A-Za-z0-9]+IPv6(\/|$)/) continue
		v4 = v6
		sub(/IPv6/, "", v4)
		if (!(v4 in seen)) continue
		if (!header++) {
			print "IPv4 and IPv6 side by side (medians; ratio IPv6 / IPv4). They ran at different"
			print "moments: compare their *ratio_to_raw rows (each against the reference in its own rounds)."
		}
		print v4 " | " v6
		nu = split(substr(units[v6], 2), us, " ")
		for (u = 1; u <= nu; u++) {
			if (!((v4 SUBSEP us[u]) in cnt) || us[u] == "peak-RSS-MB") continue
			m4 = median(v4 SUBSEP us[u])
			m6 = median(v6 SUBSEP us[u])
			if (m4 != 0) printf "  %-22s %12.4g %12.4g  %6.3f\n", us[u], m4, m6, m6 / m4
			else printf "  %-22s %12.4g %12.4g       -\n", us[u], m4, m6
		}
	}
}'
