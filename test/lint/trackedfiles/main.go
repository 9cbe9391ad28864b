// Command trackedfiles fails when a file tracked by git is a built
// executable (ELF, Mach-O, PE) or larger than a limit: nothing built is
// committed, and large files bloat every clone forever. `make lint` runs it.
package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
)

// MaxSize is the largest file the repository may track.
const MaxSize = 1 << 20

// magics are the openings of executable formats.
var magics = []struct {
	name  string
	magic []byte
}{
	{"an ELF executable", []byte("\x7fELF")},
	{"a Mach-O executable", []byte("\xcf\xfa\xed\xfe")},
	{"a Mach-O executable", []byte("\xce\xfa\xed\xfe")},
	{"a Mach-O universal binary", []byte("\xca\xfe\xba\xbe")},
	{"a Windows (PE) executable", []byte("MZ")},
}

func main() {
	dir := "."
	if len(os.Args) > 1 {
		dir = os.Args[1]
	}
	problems, err := check(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, "trackedfiles:", err)
		os.Exit(2)
	}
	for _, p := range problems {
		fmt.Fprintln(os.Stderr, p)
	}
	if len(problems) > 0 {
		fmt.Fprintf(os.Stderr, "%d tracked file(s) must not be committed: remove them with `git rm --cached FILE` and ignore them in .gitignore\n", len(problems))
		os.Exit(1)
	}
}

// check returns one line per tracked file in the git work tree dir that
// must not be committed, naming the file and why.
func check(dir string) ([]string, error) {
	out, err := exec.Command("git", "-C", dir, "ls-files", "-z").Output()
	if err != nil {
		return nil, fmt.Errorf("git ls-files in %s: %w", dir, err)
	}
	var problems []string
	for _, name := range bytes.Split(out, []byte{0}) {
		if len(name) == 0 {
			continue
		}
		p, err := checkFile(filepath.Join(dir, string(name)), string(name))
		if err != nil {
			return nil, err
		}
		if p != "" {
			problems = append(problems, p)
		}
	}
	return problems, nil
}

func checkFile(path, name string) (string, error) {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return "", nil // deleted in the work tree, not yet committed
	}
	if err != nil {
		return "", err
	}
	if !fi.Mode().IsRegular() {
		return "", nil
	}
	if fi.Size() > MaxSize {
		return fmt.Sprintf("%s: %d bytes, larger than the %d bytes a tracked file may have", name, fi.Size(), MaxSize), nil
	}
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	head := make([]byte, 4)
	n, err := io.ReadFull(f, head)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return "", err
	}
	head = head[:n]
	for _, m := range magics {
		if bytes.HasPrefix(head, m.magic) {
			return fmt.Sprintf("%s: %s, a built file", name, m.name), nil
		}
	}
	return "", nil
}
