// Package suggest finds the name a mistyped one was probably meant to be,
// for "did you mean" hints in errors and warnings about unknown names.
package suggest

import "strings"

// Closest returns the candidate nearest to name when it is near enough to be
// a typo of it: an edit distance of at most 2, or 3 for candidates of 9
// characters or more; case is ignored. It returns "" when none is.
func Closest(name string, candidates []string) string {
	name = strings.ToLower(name)
	best, bestDist := "", 0
	for _, c := range candidates {
		limit := 2
		if len(c) >= 9 {
			limit = 3
		}
		d := Distance(name, strings.ToLower(c))
		if d <= limit && (best == "" || d < bestDist) {
			best, bestDist = c, d
		}
	}
	return best
}

// Distance is the Levenshtein distance between a and b, counted in bytes
// (the names compared are ASCII).
func Distance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
