package lint

import "testing"

// The anchors GitHub makes of headings found in this repository's pages,
// so that a link checked here resolves there too.
func TestSlug(t *testing.T) {
	for title, want := range map[string]string{
		" Options (`-o`)":                         "options--o",
		" Why a pool, not \"--subnet missing\"":   "why-a-pool-not---subnet-missing",
		" Gossip timings: `--gossip-profile`":     "gossip-timings---gossip-profile",
		" Upgrading a cluster: gossip protocol 4": "upgrading-a-cluster-gossip-protocol-4",
	} {
		if got := slug(title); got != want {
			t.Errorf("slug(%q) = %q, want %q", title, got, want)
		}
	}
	s := headingSlugs("# A\n## A\n```\n# not a heading\n```\n### A\n")
	for _, want := range []string{"a", "a-1", "a-2"} {
		if !s[want] {
			t.Errorf("headingSlugs lacks %q: %v", want, s)
		}
	}
}
