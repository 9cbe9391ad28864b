package version

import (
	"runtime/debug"
	"strings"
	"testing"
)

func TestString(t *testing.T) {
	defer func(s string, f func() (*debug.BuildInfo, bool)) { stamp, readBuildInfo = s, f }(stamp, readBuildInfo)
	info := func(v string, settings ...debug.BuildSetting) func() (*debug.BuildInfo, bool) {
		return func() (*debug.BuildInfo, bool) {
			return &debug.BuildInfo{GoVersion: "go1.x", Main: debug.Module{Version: v}, Settings: settings}, true
		}
	}
	cases := []struct {
		stamp string
		info  func() (*debug.BuildInfo, bool)
		want  string
	}{
		{"v1.2.3-4-gabc", info("(devel)"), "v1.2.3-4-gabc"},
		{"", info("v0.3.0"), "v0.3.0"},
		{"", info("(devel)", debug.BuildSetting{Key: "vcs.revision", Value: "1932fb7c4e1d0123456789"},
			debug.BuildSetting{Key: "vcs.time", Value: "2026-12-02T23:10:00Z"}, debug.BuildSetting{Key: "vcs.modified", Value: "true"}),
			"devel 1932fb7c4e1d 2026-12-02T23:10:00Z modified"},
		{"", info("(devel)"), "devel (no VCS information"},
		{"", func() (*debug.BuildInfo, bool) { return nil, false }, "unknown"},
	}
	for _, c := range cases {
		stamp, readBuildInfo = c.stamp, c.info
		if got := String(); !strings.HasPrefix(got, c.want) {
			t.Errorf("stamp %q: String() = %q, want prefix %q", c.stamp, got, c.want)
		}
	}
	stamp, readBuildInfo = "v9", info("")
	if got := Long(); got != "overlayd v9 (go1.x)" {
		t.Errorf("Long() = %q", got)
	}
}
