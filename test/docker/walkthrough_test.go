package docker

import (
	"bufio"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// walkthroughStep is one command of README's two-host walkthrough and the
// hosts it runs on ("A", "B").
type walkthroughStep struct {
	hosts []string
	args  []string
}

// readmeWalkthrough returns the commands of README's "Five minutes, two
// hosts" section, in order, with the host each sh block's "# host …"
// comment names.
func readmeWalkthrough(t *testing.T) []walkthroughStep {
	t.Helper()
	f, err := os.Open(filepath.Join(moduleRoot(), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var steps []walkthroughStep
	section, block := false, false
	hosts := []string{"A", "B"} // a block without a comment: every host
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		switch {
		case strings.HasPrefix(l, "## "):
			section = l == "## Five minutes, two hosts"
		case !section:
		case strings.HasPrefix(l, "```sh"):
			block, hosts = true, []string{"A", "B"}
		case strings.HasPrefix(l, "```"):
			block = false
		case !block || l == "":
		case strings.HasPrefix(l, "# host "):
			spec, _, _ := strings.Cut(strings.TrimPrefix(l, "# host "), ":")
			hosts = nil
			for _, h := range []string{"A", "B"} {
				if strings.HasPrefix(spec, h) || strings.HasSuffix(spec, "host "+h) {
					hosts = append(hosts, h)
				}
			}
		case strings.HasPrefix(l, "#"):
		default:
			steps = append(steps, walkthroughStep{hosts: hosts, args: shellWords(t, l)})
		}
	}
	if len(steps) == 0 {
		t.Fatal("README.md: no commands in the section \"Five minutes, two hosts\"")
	}
	return steps
}

// TestReadmeWalkthrough runs README's two-host walkthrough on two engines
// of the lab, command by command as the README gives them: only the hosts'
// addresses, the key file's path and overlayd's lab paths are the lab's.
// `make install` is TestInstall's.
func TestReadmeWalkthrough(t *testing.T) {
	prepare(t)
	l := newLab(t)
	es := l.addEngines(2)
	byName := map[string]*engine{"A": es[0], "B": es[1]}
	keyFile := filepath.Join(l.dir, "cluster.key")
	subst := strings.NewReplacer("192.0.2.10", es[0].addr.String(), "192.0.2.11", es[1].addr.String(),
		"/etc/overlayd/cluster.key", keyFile)
	for _, e := range es {
		e.must("tag", image, "busybox") // the README's image
	}
	address := ""
	for _, s := range readmeWalkthrough(t) {
		args := make([]string, len(s.args))
		for i, a := range s.args {
			args[i] = subst.Replace(a)
			if a == "ADDRESS" {
				args[i] = address
			}
		}
		for _, h := range s.hosts {
			e := byName[h]
			switch args[0] {
			case "make":
				t.Logf("host %s: %s: left to TestInstall", h, strings.Join(args, " "))
			case "overlayd":
				// The README's overlayd runs with the defaults, networks
				// defined once among them (the lab's default is off).
				o := e.startOverlayd(append(args[1:], "--netsync", "on")...)
				// "Copy /var/lib/overlayd/cluster.key to host B": the
				// key the first start generated.
				if _, err := os.Stat(keyFile); os.IsNotExist(err) {
					raw, err := os.ReadFile(filepath.Join(o.stateDir, "cluster.key"))
					if err != nil {
						t.Fatalf("host %s: the key of its first start: %v", h, err)
					}
					if err := os.WriteFile(keyFile, raw, 0o600); err != nil {
						t.Fatal(err)
					}
				}
			case "docker":
				// A network created on the other host: "within seconds
				// every host's engine has it".
				if i := slices.Index(args, "--network"); i > 0 && i+1 < len(args) {
					e.waitNetwork(args[i+1], true, 10*time.Second)
				}
				out := e.must(args[1:]...)
				t.Logf("host %s: %s:\n%s", h, strings.Join(args, " "), out)
				if args[1] == "inspect" {
					address = strings.TrimSpace(out)
				}
			default:
				t.Fatalf("README walkthrough: a command the test does not know how to run: %q", strings.Join(s.args, " "))
			}
		}
	}
	if address == "" {
		t.Fatal("README walkthrough: no docker inspect printed an address")
	}
}

// shellWords splits a command line as sh does for the README's commands:
// words separated by blanks, '…' and "…" quoting (no expansions).
func shellWords(t *testing.T, l string) []string {
	t.Helper()
	var words []string
	var w strings.Builder
	in, quote := false, rune(0)
	for _, r := range l {
		switch {
		case quote != 0 && r == quote:
			quote = 0
		case quote != 0:
			w.WriteRune(r)
		case r == '\'' || r == '"':
			quote, in = r, true
		case r == ' ' || r == '\t':
			if in {
				words = append(words, w.String())
				w.Reset()
				in = false
			}
		case r == '#' && !in:
			return words // a comment
		default:
			w.WriteRune(r)
			in = true
		}
	}
	if quote != 0 {
		t.Fatalf("README walkthrough: unclosed quote in %q", l)
	}
	if in {
		words = append(words, w.String())
	}
	return words
}
