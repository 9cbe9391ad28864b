package docker

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Which Docker engine the suite drives. OVERLAYD_TEST_ENGINE names one of
// engineKinds (default: the first). Docker 20.10 is Debian 12's docker.io,
// installed system-wide as any user of this Debian would have it. Docker 26.1
// is today's engine: Debian 13's docker.io, containerd and docker-cli,
// fetched with apt-get from the Debian 13 suite of the archive this machine
// already uses and unpacked with dpkg -x into a cache directory, never
// installed: only this suite's dockerds run it (the cache's bin directories
// lead their PATH, so they start the cache's containerd and shims). The
// system runc stays: Debian 13's runc needs a newer glibc than Debian 12's.
const (
	engineEnv       = "OVERLAYD_TEST_ENGINE"
	engineCacheEnv  = "OVERLAYD_TEST_ENGINE_CACHE"  // default defaultEngineCache
	debianMirrorEnv = "OVERLAYD_TEST_DEBIAN_MIRROR" // default: the system's apt source
	// defaultEngineCache holds one directory per fetched engine. It lives
	// across runs: delete an engine's directory to fetch it anew.
	defaultEngineCache = "/var/cache/overlayd-test"
)

// engineKind is an engine the suite can run against.
type engineKind struct {
	name  string // value of OVERLAYD_TEST_ENGINE; every binary's version starts with it
	about string
	// suite is the Debian suite its packages are fetched from into the
	// cache; "" means the system's packages.
	suite    string
	packages []string // fetched packages (suite != "")
}

var engineKinds = []engineKind{
	{name: "20.10", about: "Debian 12's docker.io, installed system-wide"},
	{name: "26.1", about: "Debian 13's docker.io, containerd and docker-cli, unpacked into a cache directory, with the system runc",
		suite: "trixie", packages: []string{"docker.io", "containerd", "docker-cli"}},
	// Debian unstable: containerd 2.x, and docker-compose 2.x for the
	// compose test (the only engine that brings compose).
	{name: "28.5", about: "Debian unstable's docker.io, containerd 2, docker-cli and docker-compose, unpacked into a cache directory, with the system runc",
		suite: "sid", packages: []string{"docker.io", "containerd", "docker-cli", "docker-compose"}},
}

// selectedEngine returns the engine OVERLAYD_TEST_ENGINE names.
func selectedEngine() (engineKind, error) {
	v := os.Getenv(engineEnv)
	if v == "" {
		return engineKinds[0], nil
	}
	var known []string
	for _, k := range engineKinds {
		if k.name == v {
			return k, nil
		}
		known = append(known, fmt.Sprintf("%s (%s)", k.name, k.about))
	}
	return engineKind{}, fmt.Errorf("%s=%q: no such engine; known: %s", engineEnv, v, strings.Join(known, "; "))
}

// enginePATH is the PATH the suite's dockerds run with: "" (inherit) for a
// system engine, the cache's bin directories first for a fetched one.
var enginePATH string

// composePlugin is the engine's docker compose 2 CLI plugin, "" if it has
// none (TestCompose then skips).
var composePlugin string

// engineVersions is what the selected engine's binaries say they are.
type engineVersions struct{ dockerd, cli, containerd string }

// useEngine finds (fetching it if needed) the selected engine's binaries,
// sets dockerd, dockerCLI and enginePATH, and checks that every binary is
// of the engine's version: a run that says 26.1 must not quietly drive
// another engine.
func useEngine(k engineKind) (engineVersions, error) {
	var v engineVersions
	containerd := ""
	if k.suite == "" {
		if !findEngine() {
			return v, fmt.Errorf("engine %s: dockerd, docker CLI, containerd or runc missing after installing docker.io", k.name)
		}
		containerd = "containerd"
	} else {
		root, err := fetchEngine(k)
		if err != nil {
			return v, fmt.Errorf("engine %s (%s): %w", k.name, k.about, err)
		}
		dockerd = filepath.Join(root, "usr/sbin/dockerd")
		dockerCLI = filepath.Join(root, "usr/bin/docker")
		containerd = filepath.Join(root, "usr/bin/containerd")
		enginePATH = filepath.Join(root, "usr/sbin") + ":" + filepath.Join(root, "usr/bin") + ":" + os.Getenv("PATH")
	}
	// docker compose 2 is a CLI plugin; Debian 12's docker-compose is
	// compose 1 (Python), which TestCompose does not drive.
	plugin := "/usr/libexec/docker/cli-plugins/docker-compose"
	if k.suite != "" {
		plugin = filepath.Join(filepath.Dir(filepath.Dir(filepath.Dir(dockerCLI))), plugin)
	}
	if _, err := os.Stat(plugin); err == nil {
		composePlugin = plugin
	}
	version := func(bin string) (string, error) {
		cmd := exec.Command(bin, "--version")
		if enginePATH != "" {
			cmd.Env = append(os.Environ(), "PATH="+enginePATH)
		}
		out, err := cmd.CombinedOutput()
		s := strings.TrimSpace(string(out))
		if err != nil {
			return "", fmt.Errorf("%s --version: %v: %s", bin, err, s)
		}
		return s, nil
	}
	var err error
	if v.dockerd, err = version(dockerd); err != nil {
		return v, err
	}
	if v.cli, err = version(dockerCLI); err != nil {
		return v, err
	}
	if v.containerd, err = version(containerd); err != nil {
		return v, err
	}
	for _, b := range []struct{ path, version string }{{dockerd, v.dockerd}, {dockerCLI, v.cli}} {
		if !strings.HasPrefix(b.version, "Docker version "+k.name+".") {
			return v, fmt.Errorf("%s=%s wants Docker %s (%s), but %s is %q", engineEnv, k.name, k.name, k.about, b.path, b.version)
		}
	}
	return v, nil
}

// fetchEngine returns the root directory the engine's packages are unpacked
// in, fetching and unpacking them first unless an earlier run did. Test
// binaries of several packages may prepare at once: the install lock
// serialises them.
func fetchEngine(k engineKind) (string, error) {
	cache := os.Getenv(engineCacheEnv)
	if cache == "" {
		cache = defaultEngineCache
	}
	dir := filepath.Join(cache, "docker-"+k.name)
	root := filepath.Join(dir, "root")
	stamp := filepath.Join(dir, "packages") // written last: the unpacked tree is complete
	fetched := func() bool {
		_, err1 := os.Stat(stamp)
		_, err2 := os.Stat(filepath.Join(root, "usr/sbin/dockerd"))
		return err1 == nil && err2 == nil
	}
	if fetched() {
		return root, nil
	}
	lf, err := os.OpenFile(installLock, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return "", fmt.Errorf("install lock: %w", err)
	}
	defer lf.Close()
	if err := unix.Flock(int(lf.Fd()), unix.LOCK_EX); err != nil {
		return "", fmt.Errorf("install lock %s: %w", installLock, err)
	}
	defer unix.Flock(int(lf.Fd()), unix.LOCK_UN)
	if fetched() {
		return root, nil
	}
	start := time.Now()
	// Whatever an interrupted fetch left goes; the work directory goes
	// when done (only the unpacked tree and the stamp stay).
	work := filepath.Join(dir, "fetch")
	for _, d := range []string{stamp, root, work} {
		if err := os.RemoveAll(d); err != nil {
			return "", err
		}
	}
	defer os.RemoveAll(work)
	debs, err := aptDownload(work, k)
	if err != nil {
		return "", err
	}
	tmp := filepath.Join(work, "root")
	var versions []string
	for _, deb := range debs {
		if b, err := exec.Command("dpkg", "-x", deb, tmp).CombinedOutput(); err != nil {
			return "", fmt.Errorf("dpkg -x %s: %v: %s", deb, err, b)
		}
		out, err := exec.Command("dpkg-deb", "--showformat", "${Package} ${Version}", "--show", deb).Output()
		if err != nil {
			return "", fmt.Errorf("dpkg-deb --show %s: %w", deb, err)
		}
		versions = append(versions, string(out))
	}
	if err := os.Rename(tmp, root); err != nil {
		return "", err
	}
	if err := os.WriteFile(stamp, []byte(strings.Join(versions, "\n")+"\n"), 0o644); err != nil {
		return "", err
	}
	fmt.Printf("fetched and unpacked %s into %s in %v\n", strings.Join(versions, ", "), root, time.Since(start).Round(100*time.Millisecond))
	return root, nil
}

// aptDownload downloads k's packages from k.suite into work/debs with
// apt-get and a private apt configuration (sources, lists, cache and
// preferences under work): the system's apt lists and sources are not
// changed. It returns the .deb files.
func aptDownload(work string, k engineKind) ([]string, error) {
	src, err := debianSource()
	if err != nil {
		return nil, err
	}
	aptDir := filepath.Join(work, "apt")
	debsDir := filepath.Join(work, "debs")
	for _, d := range []string{"sources.list.d", "preferences.d", "state/lists/partial", "cache/archives/partial"} {
		if err := os.MkdirAll(filepath.Join(aptDir, d), 0o755); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(debsDir, 0o755); err != nil {
		return nil, err
	}
	line := src.line(k.suite)
	if err := os.WriteFile(filepath.Join(aptDir, "sources.list"), []byte(line+"\n"), 0o644); err != nil {
		return nil, err
	}
	opts := []string{"-q",
		"-o", "Dir::Etc::SourceList=" + filepath.Join(aptDir, "sources.list"),
		"-o", "Dir::Etc::SourceParts=" + filepath.Join(aptDir, "sources.list.d"),
		"-o", "Dir::Etc::Preferences=" + filepath.Join(aptDir, "preferences"),
		"-o", "Dir::Etc::PreferencesParts=" + filepath.Join(aptDir, "preferences.d"),
		"-o", "Dir::State=" + filepath.Join(aptDir, "state"),
		"-o", "Dir::Cache=" + filepath.Join(aptDir, "cache"),
		// The private directories are root's; apt's download user could
		// not write them.
		"-o", "APT::Sandbox::User=root",
	}
	aptGet := func(dir string, args ...string) error {
		cmd := exec.Command("apt-get", append(append([]string{}, opts...), args...)...)
		cmd.Dir = dir
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("apt-get %s (source %q): %v\n%s", strings.Join(args, " "), line, err, tail(out.String(), 20))
		}
		// apt-get update exits 0 when an index could not be fetched; it
		// says so with "W:" or "E:" lines.
		if s := out.String(); strings.Contains(s, "\nE: ") || strings.Contains(s, "Failed to fetch") || strings.Contains(s, "Some index files failed") {
			return fmt.Errorf("apt-get %s (source %q) failed:\n%s", strings.Join(args, " "), line, tail(s, 20))
		}
		return nil
	}
	if err := aptGet(work, "update"); err != nil {
		return nil, err
	}
	if err := aptGet(debsDir, append([]string{"download"}, k.packages...)...); err != nil {
		return nil, err
	}
	debs, _ := filepath.Glob(filepath.Join(debsDir, "*.deb"))
	if len(debs) != len(k.packages) {
		return nil, fmt.Errorf("apt-get download %v (source %q) gave %d files, want %d", k.packages, line, len(debs), len(k.packages))
	}
	sort.Strings(debs)
	return debs, nil
}

// aptSource is the Debian archive the system's apt uses.
type aptSource struct {
	uri      string
	signedBy string // keyring file, or "" (apt's trusted keys)
}

// line is the one-line sources.list entry for suite's main component.
func (s aptSource) line(suite string) string {
	opt := ""
	if s.signedBy != "" {
		opt = "[signed-by=" + s.signedBy + "] "
	}
	return "deb " + opt + s.uri + " " + suite + " main"
}

// debianSource is the archive the system installs its Debian release from
// (the source whose suite is the release's codename), so that the fetch
// uses the same mirror (and proxy settings) as the machine; or the mirror
// OVERLAYD_TEST_DEBIAN_MIRROR names.
func debianSource() (aptSource, error) {
	if m := os.Getenv(debianMirrorEnv); m != "" {
		return aptSource{uri: m, signedBy: "/usr/share/keyrings/debian-archive-keyring.gpg"}, nil
	}
	codename, err := osCodename("/etc/os-release")
	if err != nil {
		return aptSource{}, err
	}
	files := []string{"/etc/apt/sources.list"}
	for _, pat := range []string{"/etc/apt/sources.list.d/*.list", "/etc/apt/sources.list.d/*.sources"} {
		m, _ := filepath.Glob(pat)
		files = append(files, m...)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if s, ok := findDebianSource(string(b), strings.HasSuffix(f, ".sources"), codename); ok {
			return s, nil
		}
	}
	return aptSource{}, fmt.Errorf("no apt source for the Debian suite %q (main) in %v; set %s to a Debian mirror (e.g. http://deb.debian.org/debian)",
		codename, files, debianMirrorEnv)
}

// osCodename reads VERSION_CODENAME from an os-release file.
func osCodename(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VERSION_CODENAME="); ok && strings.Trim(v, `"`) != "" {
			return strings.Trim(v, `"`), nil
		}
	}
	return "", fmt.Errorf("%s: no VERSION_CODENAME (not Debian?)", path)
}

// findDebianSource finds, in the text of a sources file (deb822 or
// one-line format), a "deb" source that carries suite with component main.
func findDebianSource(text string, deb822 bool, suite string) (aptSource, bool) {
	if deb822 {
		for _, para := range strings.Split(text, "\n\n") {
			f := deb822Fields(para)
			if !contains(strings.Fields(f["types"]), "deb") || !contains(strings.Fields(f["suites"]), suite) ||
				!contains(strings.Fields(f["components"]), "main") || strings.EqualFold(f["enabled"], "no") {
				continue
			}
			uris := strings.Fields(f["uris"])
			if len(uris) == 0 {
				continue
			}
			s := aptSource{uri: uris[0]}
			if k := f["signed-by"]; strings.HasPrefix(k, "/") && !strings.ContainsAny(k, " \n") {
				s.signedBy = k // a file (an inline key block cannot be reused in a one-line entry)
			}
			return s, true
		}
		return aptSource{}, false
	}
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if i := strings.IndexByte(l, '#'); i >= 0 {
			l = strings.TrimSpace(l[:i])
		}
		rest, ok := strings.CutPrefix(l, "deb ")
		if !ok {
			continue
		}
		rest = strings.TrimSpace(rest)
		s := aptSource{}
		if strings.HasPrefix(rest, "[") {
			end := strings.IndexByte(rest, ']')
			if end < 0 {
				continue
			}
			for _, o := range strings.Fields(rest[1:end]) {
				if v, ok := strings.CutPrefix(o, "signed-by="); ok {
					s.signedBy = v
				}
			}
			rest = rest[end+1:]
		}
		f := strings.Fields(rest)
		if len(f) < 3 || f[1] != suite || !contains(f[2:], "main") {
			continue
		}
		s.uri = f[0]
		return s, true
	}
	return aptSource{}, false
}

// deb822Fields parses one deb822 paragraph into lower-cased keys and their
// values (continuation lines joined with newlines); comment lines are skipped.
func deb822Fields(para string) map[string]string {
	fields := map[string]string{}
	key := ""
	for _, l := range strings.Split(para, "\n") {
		if strings.HasPrefix(l, "#") {
			continue
		}
		if key != "" && (strings.HasPrefix(l, " ") || strings.HasPrefix(l, "\t")) {
			fields[key] += "\n" + strings.TrimSpace(l)
			continue
		}
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			key = ""
			continue
		}
		key = strings.ToLower(strings.TrimSpace(k))
		fields[key] = strings.TrimSpace(v)
	}
	return fields
}
