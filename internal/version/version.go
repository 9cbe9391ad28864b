// Package version says which overlayd this is: the version stamped at build
// time (make build passes -ldflags "-X .../internal/version.stamp=...",
// from git describe), else what the Go toolchain recorded in the binary
// (the module version, or the VCS revision of a plain `go build`).
package version

import (
	"fmt"
	"runtime/debug"
)

// stamp is set by the linker (-X); empty in a plain `go build`.
var stamp string

// readBuildInfo is debug.ReadBuildInfo (a variable for tests).
var readBuildInfo = debug.ReadBuildInfo

// String returns the version, for example "v0.3.0-12-g1932fb7" (stamped),
// "v0.3.0" (go install of a tagged module) or "devel 1932fb7c4e1d
// 2026-12-02T23:10:00Z modified" (a build in a work tree), never "".
func String() string {
	if stamp != "" {
		return stamp
	}
	bi, ok := readBuildInfo()
	if !ok {
		return "unknown (built without module support)"
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	var rev, at string
	modified := false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.time":
			at = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	if rev == "" {
		return "devel (no VCS information: built outside a git checkout or with -buildvcs=false)"
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	v := "devel " + rev
	if at != "" {
		v += " " + at
	}
	if modified {
		v += " modified"
	}
	return v
}

// Long returns String with the Go version that built the binary, for
// `overlayd version`.
func Long() string {
	gov := "unknown Go"
	if bi, ok := readBuildInfo(); ok {
		gov = bi.GoVersion
	}
	return fmt.Sprintf("overlayd %s (%s)", String(), gov)
}
