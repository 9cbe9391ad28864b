package docker

import (
	"os"
	"path/filepath"
	"testing"
)

// TestFindDebianSource: the 26.1 engine is fetched from the archive the
// machine's apt already uses; the source is found in either sources format,
// and neither the security archive, a disabled entry, a commented line nor
// another suite is taken for it.
func TestFindDebianSource(t *testing.T) {
	cases := []struct {
		name   string
		deb822 bool
		text   string
		want   aptSource
		found  bool
	}{
		{name: "deb822 as on this machine", deb822: true, found: true,
			text: `Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
`,
			want: aptSource{uri: "http://deb.debian.org/debian", signedBy: "/usr/share/keyrings/debian-archive-keyring.gpg"}},
		{name: "deb822 security first, disabled mirror, then the archive", deb822: true, found: true,
			text: `Types: deb
URIs: http://security.debian.org/debian-security
Suites: bookworm-security
Components: main

Enabled: no
Types: deb
URIs: http://old.example/debian
Suites: bookworm
Components: main

Types: deb deb-src
URIs: http://mirror.example/debian
Suites: bookworm
Components: main contrib
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 .
 -----END PGP PUBLIC KEY BLOCK-----
`,
			want: aptSource{uri: "http://mirror.example/debian"}},
		{name: "one-line with options", found: true,
			text: "# deb http://commented.example/debian bookworm main\n" +
				"deb-src http://src.example/debian bookworm main\n" +
				"deb http://security.debian.org/debian-security bookworm-security main\n" +
				"deb [arch=amd64 signed-by=/etc/apt/keyrings/debian.gpg] http://mirror.example/debian bookworm main non-free # local\n",
			want: aptSource{uri: "http://mirror.example/debian", signedBy: "/etc/apt/keyrings/debian.gpg"}},
		{name: "one-line without main", text: "deb http://mirror.example/debian bookworm contrib\n"},
		{name: "another release only", deb822: true,
			text: "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bullseye\nComponents: main\n"},
	}
	for _, c := range cases {
		got, ok := findDebianSource(c.text, c.deb822, "bookworm")
		if ok != c.found || got != c.want {
			t.Errorf("%s: got %+v, %v; want %+v, %v", c.name, got, ok, c.want, c.found)
		}
	}
	if got := (aptSource{uri: "http://mirror.example/debian", signedBy: "/k.gpg"}).line("trixie"); got != "deb [signed-by=/k.gpg] http://mirror.example/debian trixie main" {
		t.Errorf("sources line %q", got)
	}
}

// TestSelectedEngine: OVERLAYD_TEST_ENGINE picks the engine; a value that
// names none fails the run (naming the known ones) rather than running
// another engine.
func TestSelectedEngine(t *testing.T) {
	for env, want := range map[string]string{"": "20.10", "20.10": "20.10", "26.1": "26.1", "28.5": "28.5"} {
		t.Setenv(engineEnv, env)
		k, err := selectedEngine()
		if err != nil || k.name != want {
			t.Errorf("%s=%q: engine %q, %v; want %s", engineEnv, env, k.name, err, want)
		}
	}
	t.Setenv(engineEnv, "26")
	if _, err := selectedEngine(); err == nil {
		t.Errorf("%s=26: no error", engineEnv)
	} else {
		t.Log(err)
	}
}

// TestOSCodename reads the release's codename as Debian's os-release has it.
func TestOSCodename(t *testing.T) {
	p := filepath.Join(t.TempDir(), "os-release")
	os.WriteFile(p, []byte("PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nVERSION_ID=\"12\"\nVERSION_CODENAME=bookworm\nID=debian\n"), 0o644)
	if got, err := osCodename(p); err != nil || got != "bookworm" {
		t.Errorf("codename %q, %v", got, err)
	}
	os.WriteFile(p, []byte("ID=alpine\n"), 0o644)
	if _, err := osCodename(p); err == nil {
		t.Errorf("no error for an os-release without VERSION_CODENAME")
	}
}
